"""Expert-cache admission inside a captured decode step: a routed expert missing from a layer's slot pool takes the
slot of the least recently used resident, on the device, before the MoE kernels run — and they write it into that
slot as they read it from host memory (ops/moe_int4_decode_triton.py), so an admitted expert crosses PCIe once.
The pools' keeper is cache/expert_claim_pool.py (ClaimPool).

One layer's state, all on the device, updated in place:
    table     [E] int64  expert → its slot (≥ 0); -1 not resident (read from host memory); ≤ -2 admitted in this
                         step into slot −t−2 (read from host memory and written there); the next call makes it
                         resident (its step has ended: the slot holds it)
    last_used [E] int64  the step the expert was last routed in
    clock     [1] int64  this layer's step count (the call adds one)
    counts    [3] int64  hits, misses, admitted — summed (each distinct routed expert of a step counted once)
    ids [rows, k] routed experts; `rows` of them real (an int32 [1] tensor on the device, or all: None)
    weights [rows, k] their routing weights, or None: a choice of weight exactly 0 is not routed (expert parallel's
                         choices of other ranks, which the MoE kernels skip: ops/moe_int4_decode_triton.py)

First every routed expert is marked used in this step (the residents among them count as hits); then each miss, in
expert order, evicts the resident least recently used (ties: the lower expert id) — never one routed in this step;
when every resident is, the miss is read from host memory and not admitted. `claim_slots_reference` is the
definition; `claim_slots` sends CUDA tensors to one Triton program of one warp: the step's clock stored at the routed
ids and the E last uses read back whole, then a loop over the misses alone (~1.5 a layer a token at 87% hits). FLASHNEXT_EXPERT_CLAIMS=reference forces the reference (it
syncs with the host: on CUDA the step then cannot be captured and runs eagerly).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from flashnext.ops.pdl import launch_options, wait_for_inputs


def claim_slots_reference(table: torch.Tensor, last_used: torch.Tensor, clock: torch.Tensor, counts: torch.Tensor,
                          ids: torch.Tensor, rows: torch.Tensor | None, weights: torch.Tensor | None = None) -> None:
    admitted = table <= -2
    table[admitted] = -table[admitted] - 2
    clock += 1
    now = int(clock)
    live = ids.shape[0] if rows is None else min(int(rows), ids.shape[0])
    chosen = ids[:live] if weights is None else ids[:live][weights[:live] != 0]
    routed = sorted(set(chosen.flatten().tolist()))
    last_used[routed] = now
    missed = [e for e in routed if table[e] < 0]
    counts[0] += len(routed) - len(missed)
    counts[1] += len(missed)
    for e in missed:
        candidates = (table >= 0) & (last_used < now)
        if not candidates.any():
            break
        victim = int(torch.where(candidates, last_used, torch.iinfo(torch.int64).max).argmin())
        table[e] = -int(table[victim]) - 2
        table[victim] = -1
        counts[2] += 1


@triton.jit
def _claim_kernel(table_ptr, last_used_ptr, clock_ptr, counts_ptr, ids_ptr, rows_ptr, weights_ptr, max_rows, E,
                  TOP_K: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_IDS: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    table = tl.load(table_ptr + offs, mask=ok, other=-1)
    table = tl.where(table <= -2, -table - 2, table)
    now = tl.load(clock_ptr) + 1
    rows = max_rows
    if HAS_ROWS:
        rows = tl.minimum(tl.load(rows_ptr).to(tl.int32), max_rows)
    # every routed expert used now: stored at the routed ids (an id twice stores the same), then read back whole
    at = tl.arange(0, BLOCK_IDS)
    live = at < rows * TOP_K
    ids = tl.load(ids_ptr + at, mask=live, other=0)
    if HAS_WEIGHTS:   # a choice of weight 0 is not routed
        live = tl.where(tl.load(weights_ptr + at, mask=live, other=0.0) != 0.0, live, False)
    tl.store(last_used_ptr + ids, now, mask=live & (ids >= 0) & (ids < E))
    tl.debug_barrier()
    last = tl.load(last_used_ptr + offs, mask=ok, other=0)
    routed = (last == now) & ok
    hits = tl.sum((routed & (table >= 0)).to(tl.int64), axis=0)
    missed = routed & (table < 0)
    misses = tl.sum(missed.to(tl.int64), axis=0)
    # the misses in expert order, each into the least recently used resident's slot while one is left
    admitted = tl.full((), 0, tl.int64)
    never = tl.full((), 9223372036854775807, tl.int64)   # no candidate's last use
    for _ in range(0, misses):
        e = tl.min(tl.where(missed, offs, BLOCK_E), axis=0)
        missed = missed & (offs != e)
        candidate = (table >= 0) & (last < now) & ok
        if tl.sum(candidate.to(tl.int32), axis=0) > 0:
            oldest = tl.min(tl.where(candidate, last, never), axis=0)
            victim = tl.min(tl.where(candidate & (last == oldest), offs, BLOCK_E), axis=0)
            slot = tl.sum(tl.where(offs == victim, table, 0), axis=0)
            table = tl.where(offs == victim, -1, table)
            table = tl.where(offs == e, -slot - 2, table)
            admitted += 1
    tl.store(table_ptr + offs, table, mask=ok)
    tl.store(clock_ptr, now)
    tl.store(counts_ptr, tl.load(counts_ptr) + hits)
    tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + misses)
    tl.store(counts_ptr + 2, tl.load(counts_ptr + 2) + admitted)


def claim_slots(table: torch.Tensor, last_used: torch.Tensor, clock: torch.Tensor, counts: torch.Tensor,
                ids: torch.Tensor, rows: torch.Tensor | None, weights: torch.Tensor | None = None) -> None:
    """claim_slots_reference, on CUDA in one launch without a host sync (CUDA-graph capturable)."""
    if not ids.is_cuda or os.environ.get("FLASHNEXT_EXPERT_CLAIMS", "triton") == "reference":
        return claim_slots_reference(table, last_used, clock, counts, ids, rows, weights)
    _claim_launch(table, last_used, clock, counts, ids, rows, weights)


def _claim_launch(table, last_used, clock, counts, ids, rows, weights=None) -> None:
    flat = ids.reshape(-1).contiguous()
    flat_weights = flat if weights is None else weights.reshape(-1).contiguous()   # never read without HAS_WEIGHTS
    _claim_kernel[(1,)](table, last_used, clock, counts, flat, flat if rows is None else rows, flat_weights,
                        ids.shape[0], table.shape[0], TOP_K=ids.shape[1], HAS_ROWS=rows is not None,
                        HAS_WEIGHTS=weights is not None,
                        BLOCK_E=triton.next_power_of_2(table.shape[0]), BLOCK_IDS=triton.next_power_of_2(flat.numel()),
                        num_warps=1, **launch_options(ids.device))
