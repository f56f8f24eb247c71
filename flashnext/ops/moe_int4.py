"""Routed experts with INT4 weights: a readable torch reference and the dispatch to the Triton kernels.

Shapes: x [M, H]; topk_ids [M, k] (int); topk_weights [M, k]; w_gate_up a stacked Int4Weight of the
[E, 2I, H] gate|up weights (gate rows first, as `Experts.gate_up_proj`); w_down a stacked Int4Weight of
the [E, H, I] down weights. Returns [M, H] in x's dtype:
    out[m] = sum_j topk_weights[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])),  e = topk_ids[m, j]
           (+ sigmoid(shared.logit[m]) * down_s(silu(gate_s(x[m])) * up_s(x[m])) with a `SharedExpert`)
A choice of weight exactly 0 contributes nothing and its expert is not computed (expert parallel hands a rank the
choices of other ranks that way, parallel/layers.py) — by the reference and the decode kernels; the grouped kernels
(more rows) compute it times 0, which differs only where that expert's output is not finite. The kernel layout (qweight int32 [E, K/8, N], scales
[E, K/g, N], zeros uint8 [E, K/g, N] or None) is docs/int4.md's; `flashnext.weights.int4_layout` owns it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashnext.weights.int4_layout import Int4Weight, dequantize

# FLASHNEXT_MOE_INT4: "auto" (default: decode kernels up to decode_max_m() tokens, prefill_path's kernels above),
# "grouped" (the grouped kernels at every M), "reference" (the torch reference on CUDA too; debugging).
_BACKEND = os.environ.get("FLASHNEXT_MOE_INT4", "auto")
# The decode kernels re-read an expert per token that chose it. They take resident experts up to DECODE_MAX_M rows
# (FLASHNEXT_MOE_DECODE_MAX_M, read at each call: a step traced or captured keeps what it read), the transposed
# tiles above: on the H200 (scripts/gpu_moe.py flash-next --magic, session 24, per layer, L2 flushed) the decode
# kernels 0.108 / 0.199 / 0.379 / 0.732 ms at 8 / 16 / 32 / 64 tokens against the transposed tiles' 0.187 / 0.205 /
# 0.337 / 0.450 (0.187 / 0.290 / 0.467 / 0.640 without the magic-number dequantisation, FLASHNEXT_INT4_MAGIC=0: how
# fp16 scales beside bf16 activations run) — so 32, where the tiles' lead is small enough that the shared expert,
# inside the decode kernels and on its own beside the tiles (its launches not timed apart), may take it back. (Session 14 measured the grouped kernels' 392 / 588 / 805 µs at 16 / 32 / 64.) An expert
# cache's pool goes through the decode kernels in the same range (runs_cached_experts), its larger batches through
# the grouped kernels a round of experts at a time.
DECODE_MAX_M = 32


def decode_max_m() -> int:
    """The most rows the decode kernels take (see DECODE_MAX_M)."""
    return int(os.environ.get("FLASHNEXT_MOE_DECODE_MAX_M", DECODE_MAX_M))


# Prefill-sized MoE of resident experts (FLASHNEXT_MOE_PREFILL, read at each call — prefill sizes only — so a script
# can time every path on one model): "auto" (default) by the average (token, choice) rows an expert gets — the
# transposed-tile kernels (ops/moe_int4_swapped_triton.py) below DEQUANT_MIN_ROWS_PER_EXPERT, the grouped GEMM over
# dequantised experts (ops/moe_int4_dequant.py) from there; experts the transposed tiles do not take (act-order,
# groups below 128) go from the grouped kernels to the dequantised ones at GROUPED_MAX_ROWS_PER_EXPERT (session 18's
# measured crossing); "triton", "swapped", "dequant": that path at every size past decode_max_m(). H200, ms per layer
# (scripts/gpu_moe.py --swapped-sizes, session 20; 512 experts, top-10, so rows an expert = tokens / 51.2; the
# transposed tiles at their `config_for` tiles, before the magic-number dequantisation, which took 1.4× off them up
# to 256 tokens and 5–9% from 4,096: docs/int4.md):
#     tokens (rows an expert)   Flash-Next: grouped / transposed / dequant   Qwen3-Next: grouped / transposed / dequant
#     128 (2.5)                 1.043 / 0.910 / 3.196                        0.794 / 0.925 / 2.083
#     256 (5)                   1.626 / 0.932 / 3.289                        1.107 / 0.941 / 2.145
#     1,024 (20)                1.710 / 1.147 / 3.390                        1.196 / 0.823 / 2.206
#     4,096 (80)                3.237 / 2.107 / 3.564                        2.188 / 1.498 / 2.394
#     8,192 (160)               5.046 / 3.942 / 4.090                        3.415 / 2.731 / 2.784
#     10,000 (195)              5.886 / 4.288 / 4.249                        3.993 / 2.950 / 2.918
#     16,384 (320)              9.484 / 7.001 / 6.384                        6.124 / 4.546 / 4.323
# Session 24 with the trick (scripts/gpu_moe.py --magic): the transposed tiles 0.571 ms at 128 tokens, 0.450 at 64
# (Flash-Next), so they take every size past the decode kernels; against the dequant path 3.970 / 4.177 ms at
# 10,000 tokens, 6.306 / 6.314 at 16,384 (Qwen3-Next 2.702 / 2.828, 4.251 / 4.226), so the dequant path from 320 rows
# an expert (16,384 tokens; 195 before).
DEQUANT_MIN_ROWS_PER_EXPERT = 320
GROUPED_MAX_ROWS_PER_EXPERT = 100


def prefill_path(rows: int, top_k: int, num_experts: int, w_gate_up: Int4Weight, w_down: Int4Weight,
                 device: torch.device) -> str:
    """Which kernels `moe_int4` runs `rows` tokens of resident experts through on CUDA: "decode" (up to
    decode_max_m()), "grouped" (also at every size past it with FLASHNEXT_MOE_INT4=grouped), "swapped" or "dequant"."""
    if rows <= decode_max_m() and _BACKEND != "grouped":
        return "decode"
    mode = os.environ.get("FLASHNEXT_MOE_PREFILL", "auto")
    if _BACKEND != "auto" or mode == "triton":
        return "grouped"
    per_expert = rows * top_k / num_experts
    if mode == "dequant" or (mode == "auto" and per_expert >= DEQUANT_MIN_ROWS_PER_EXPERT):
        return "dequant"
    if mode in ("swapped", "auto"):
        from flashnext.ops.moe_int4_swapped_triton import runs_swapped

        if runs_swapped(w_gate_up, w_down, device):
            return "swapped"
    if mode == "auto" and per_expert >= GROUPED_MAX_ROWS_PER_EXPERT:
        return "dequant"
    return "grouped"


@dataclass(frozen=True)
class SharedExpert:
    """A shared expert with INT4 weights, added to the routed sum gated by sigmoid(logit): gate_up [H/8, 2I] words
    (gate columns first, as a routed expert's), down [I/8, H], logit [M, 1] (any row stride). At decode the
    kernels run it as one more expert per token, so its GEMVs cost no launches of their own."""
    gate_up: Int4Weight
    down: Int4Weight
    logit: torch.Tensor


@dataclass(frozen=True)
class CachedExperts:
    """The routed experts of an expert cache (cache/expert_cache.py) for the decode kernels: the stacks passed to
    `moe_int4` are its device pool of slots, `table` [E] int64 on the device each expert's slot or -1, `gate_up` and
    `down` the stacked host store of every expert (page-locked on a GPU machine), from which the kernels read a
    missing expert's row straight over PCIe. The pool rows are copies of host rows, so the result is the
    reference's over the host store. With `admits` (captured decode steps, cache/expert_claim_pool.py) an entry
    ≤ -2 is an expert admitted in this step into slot −t−2 (ops/expert_claims.py): read from the host like a
    missing one, and written into that slot as it is read. Without it (the eager path, whose table a settled pool
    leaves ≥ -1) the kernels are compiled without the write code. `live_rows` (int32 [1] on the device, or None:
    every row): the rows of a captured decode step that are real; the kernels skip the padding rows past them
    (their outputs are zero), which would otherwise read their experts — routed from a padding token, never
    claimed by the pools — over PCIe."""
    table: torch.Tensor
    gate_up: Int4Weight
    down: Int4Weight
    live_rows: torch.Tensor | None = None
    admits: bool = False


def shared_fits(w_gate_up: Int4Weight, w_down: Int4Weight, shared_gate_up: Int4Weight, shared_down: Int4Weight) -> bool:
    """Whether the kernels can run a shared expert beside these routed ones: the same intermediate size, group
    sizes, zero form and scale dtype (one set of constexprs serves both), no act-order, one token's words
    contiguous ([H/8, 2I] and [I/8, H])."""
    pairs = ((w_gate_up, shared_gate_up), (w_down, shared_down))
    return all(
        s.qweight.dim() == 2 and s.qweight.shape == r.qweight.shape[1:] and s.group_size == r.group_size
        and s.scales.dtype == r.scales.dtype and (s.zeros is None) == (r.zeros is None)
        and r.perm is None and s.perm is None and all(t.is_contiguous() for t in s.tensors().values())
        for r, s in pairs)


def _expert(w: Int4Weight, e: int) -> Int4Weight:
    pick = (lambda t: None if t is None else t[e])
    return Int4Weight(w.qweight[e], w.scales[e], pick(w.zeros), pick(w.perm), w.group_size)


def _expert_fp32(xf, w_gate_up: Int4Weight, w_down: Int4Weight) -> torch.Tensor:
    gate, up = F.linear(xf, dequantize(w_gate_up)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, dequantize(w_down))


def moe_int4_reference(x, topk_ids, topk_weights, w_gate_up: Int4Weight, w_down: Int4Weight,
                       shared: SharedExpert | None = None) -> torch.Tensor:
    """Dequantise each chosen expert once, run its tokens through it in fp32, add them up in fp32."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in topk_ids.unique().tolist():
        token, slot = torch.where((topk_ids == e) & (topk_weights != 0))
        if not len(token):
            continue
        y = _expert_fp32(xf[token], _expert(w_gate_up, e), _expert(w_down, e))
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    add_shared_reference(out, xf, shared)
    return out.to(x.dtype)


def add_shared_reference(out: torch.Tensor, xf: torch.Tensor, shared: SharedExpert | None) -> None:
    """The reference's last term: the gated shared expert added to the fp32 sum `out` (x in fp32: xf)."""
    if shared is not None:
        out += torch.sigmoid(shared.logit.float()) * _expert_fp32(xf, shared.gate_up, shared.down)


def runs_shared_expert(x) -> bool:
    """Whether `moe_int4` takes a SharedExpert for this input: the decode kernels run it as one more expert (CUDA,
    M <= decode_max_m(), FLASHNEXT_MOE_INT4=auto), the reference adds it; the grouped kernels do not (the model then
    runs the shared expert on its own)."""
    if not x.is_cuda or _BACKEND == "reference":
        return True
    return x.shape[0] <= decode_max_m() and _BACKEND != "grouped"


def moe_int4(x, topk_ids, topk_weights, w_gate_up: Int4Weight, w_down: Int4Weight,
             shared: SharedExpert | None = None, cached: CachedExperts | None = None) -> torch.Tensor:
    """CUDA: M <= decode_max_m() -> the decode GEMV kernels (moe_int4_decode_triton; they run `shared` as one more
    expert), larger M -> as `prefill_path` says: the grouped kernels (moe_int4_triton), the transposed-tile kernels
    (moe_int4_swapped_triton) or the grouped GEMM over dequantised experts (moe_int4_dequant); elsewhere the
    reference.
    `shared` only where runs_shared_expert(x); `cached` (the stacks are an expert cache's pool) where
    runs_cached_experts(x)."""
    if shared is not None and not runs_shared_expert(x):
        raise ValueError(f"the grouped INT4 MoE kernels do not run a shared expert ({x.shape[0]} rows)")
    if cached is not None and not runs_cached_experts(x):
        raise ValueError(f"the grouped INT4 MoE kernels do not read an expert cache's pool ({x.shape[0]} rows)")
    if x.is_cuda and _BACKEND != "reference":
        path = prefill_path(x.shape[0], topk_ids.shape[1], w_gate_up.qweight.shape[0], w_gate_up, w_down, x.device)
        if path == "decode":
            from flashnext.ops.moe_int4_decode_triton import moe_int4_decode

            return moe_int4_decode(x, topk_ids, topk_weights, w_gate_up, w_down, shared=shared, cached=cached)
        if path == "swapped":
            from flashnext.ops.moe_int4_swapped_triton import moe_int4_swapped

            return moe_int4_swapped(x, topk_ids, topk_weights, w_gate_up, w_down)
        if path == "dequant":
            from flashnext.ops.moe_int4_dequant import moe_int4_dequant

            return moe_int4_dequant(x, topk_ids, topk_weights, w_gate_up, w_down)
        return routed_pairs(x, topk_ids, topk_weights, w_gate_up, w_down).sum(1).to(x.dtype)
    if cached is None:
        return moe_int4_reference(x, topk_ids, topk_weights, w_gate_up, w_down, shared)
    # what the kernels read: residents from their pool slots, the others from the host; padding rows zero
    pool_gate_up, pool_down = w_gate_up, w_down
    w_gate_up, w_down = (through_table(pool, host, cached.table)
                         for pool, host in ((w_gate_up, cached.gate_up), (w_down, cached.down)))
    out = moe_int4_reference(x, topk_ids, topk_weights, w_gate_up, w_down, shared)
    if cached.admits:
        rows = x.shape[0] if cached.live_rows is None else int(cached.live_rows)
        for pool, host in ((pool_gate_up, cached.gate_up), (pool_down, cached.down)):
            write_admitted(pool, host, cached.table, topk_ids[:rows])
    if cached.live_rows is None:
        return out
    live = torch.arange(x.shape[0], device=x.device) < cached.live_rows.to(x.device)
    return torch.where(live[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def write_admitted(pool: Int4Weight, host: Int4Weight, table: torch.Tensor, ids: torch.Tensor) -> None:
    """What the decode kernels do beside reading: each routed expert admitted in this step (table ≤ -2) is
    written into its pool slot from the host store."""
    routed = ids.reshape(-1).unique()
    admitted = routed[table[routed] <= -2]
    if not len(admitted):
        return
    slots = -table[admitted] - 2
    for name, rows in host.tensors().items():
        target = getattr(pool, name)
        target[slots] = rows[admitted.to(rows.device)].to(target.device)


def through_table(pool: Int4Weight, host: Int4Weight, table: torch.Tensor) -> Int4Weight:
    """The whole stack as an expert cache's kernels see it: expert e's rows from pool slot table[e] when that is
    >= 0, else from the host store (a copy: the reference path, on the CPU)."""
    resident = (table >= 0).nonzero().flatten()

    def merged(pool_t, host_t):
        if host_t is None:
            return None
        out = host_t.clone()
        out[resident] = pool_t[table[resident]]
        return out

    return Int4Weight(*(merged(getattr(pool, n), getattr(host, n)) for n in ("qweight", "scales", "zeros", "perm")),
                      host.group_size)


def runs_cached_experts(x) -> bool:
    """Whether `moe_int4` takes CachedExperts for this input: the decode kernels (as runs_shared_expert), or the
    reference (over the host store, on the CPU)."""
    if x.device.type == "cpu":
        return True
    return x.is_cuda and _BACKEND == "auto" and x.shape[0] <= decode_max_m()


def routed_pairs(x, topk_ids, topk_weights, w_gate_up: Int4Weight, w_down: Int4Weight) -> torch.Tensor:
    """The grouped kernels' (CUDA, any M) terms before their sum over the k choices: [M, k, H] fp32, each
    topk_weights[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])). A (token, choice)'s term depends on its own row
    only, so a caller may compute the terms in several calls (an expert cache's rounds) and sum once: the same
    result as one call with the Triton kernels (H200: scripts/gpu_expert_cache.py). An expert cache's prefill takes
    these, never the dequantised path (its scratch, a whole layer's experts in 16 bits, is what a cache is short of):
    its results equal an all-resident model's with FLASHNEXT_MOE_PREFILL=triton."""
    from flashnext.ops.moe_int4_triton import moe_int4_triton_pairs

    return moe_int4_triton_pairs(x, topk_ids, topk_weights, w_gate_up, w_down)
