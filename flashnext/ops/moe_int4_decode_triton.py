"""Routed experts with INT4 weights for decode (M <= decode_max_m() tokens): two GEMV kernels, no sort (reference:
ops/moe_int4.py; ops.moe_int4.moe_int4 sends M <= decode_max_m() here on CUDA).

At decode the expert weights are the whole cost (Flash-Next: ~25 MB of INT4 per layer at M = 1, ~6 µs at
4.27 TB/s), so the kernels are shaped for bytes in flight, not for tensor cores:
  1. gate_up: a program per (token·slot pair, BLOCK_N columns of I, K split). It reads its expert's gate
     and up tiles of the same columns, unpacks the nibbles in registers and multiplies them with the
     token's activation in fp32 on CUDA cores; h = silu(gate) * up, fp32, [M*slots, I].
  2. down: a program per (pair, BLOCK_N columns of H, K split), the routing weight folded in; the slots*splits
     partials of a token are added into out [M, H] (x's dtype) by the kernel itself.
A token has k slots, or k + 1 with a shared expert (ops.moe_int4.SharedExpert): slot k reads the shared
expert's words instead of a routed one's and weighs it by sigmoid of its gate logit. A routed slot of weight exactly 0
is skipped (its K loop empty, nothing read): under expert parallel the choices routed to other ranks reach a rank's
kernels that way (parallel/layers.py LocalExperts.decode), about half of them with two ranks.
No padding of M, no sort, no block table; an expert chosen by several tokens is read once per token
(up to M times: accepted up to ops.moe_int4.decode_max_m(), where the transposed-tile kernels take over).

Split-K and the sum over k without atomics on the values: each program stores its fp32 partial, then
counts itself in with one atomic on a per-tile counter; the program that arrives last adds all the
partials of the tile in a fixed order (a tl.sum over them) and resets the counter. So results are the same
bits run to run, and, the splits being chosen from the shapes and not from M, a token gets the same bits
at any M. The counters live in one zeroed buffer per device that the kernels leave zeroed, so a call
needs no memset; two of these kernels must not run concurrently on one device (they are issued on the
decode stream, one layer after the other).

Dequantisation without int -> float conversions (I2F is quarter rate, and a layer has ~50 M weights at
M = 1, so instructions per weight matter as much as bytes): nibble j of a word, masked in place and read as
an fp32, is the denormal q * 16**j * 2**-149 exactly (denormals are kept: fma.rn.f32, no ftz). Multiplying
it by x * 2**(96 - 4j) gives x * q * 2**-53 for every j, so a weight costs one and + one fma; the zero point
comes off per word (zero * the sum of the word's 8 activations) and 2**53 goes back with the group scale.
The upper four nibbles of a word go through one shift by 12. The products are exact in fp32; the sums
differ from sum(x * (q - zero)) only in rounding (~1e-7 relative on the tests). Scaled x stays finite for
|x| < 2**32; only products below ~2**-70 (irrelevant) lose bits as denormals. BLOCK_K divides the group
size, so a K tile has one scale and one zero per column.

No host sync and static shapes: the call can be captured in a CUDA graph (scratch is torch.empty).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.ops.arrival import arrival_counters, arrive_last
from flashnext.ops.device import num_sms
from flashnext.ops.int4_groups import group_zero_scale
from flashnext.ops.moe_int4 import CachedExperts, SharedExpert, shared_fits
from flashnext.ops.moe_int4_triton import block_k_for_group
from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.weights.int4_layout import Int4Weight


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 32      # output columns per program (H200 sweep: 32 has the least time summed over M = 1…8)
    down_block_n: int = 0  # down's output columns per program; 0: block_n
    block_k: int = 128     # K rows per loop step, lowered to divide the group size
    split_k: int = 0       # K splits of gate_up (over H); 0: enough for ~PROGRAMS_PER_SM programs at M = 1
    split_down: int = 0    # K splits of down (over I); 0: the same rule
    num_warps: int = 4
    num_stages: int = 3    # software pipelining depth of the weight loads (tl.range)


DEFAULT = DecodeConfig()
PROGRAMS_PER_SM = 4


# Activations are scaled by 2**96 / 16**j so that times a nibble read as the denormal q * 16**j * 2**-149
# they give x * q * 2**-53; 2**53 comes back with the group scale.
_X_SCALE = tl.constexpr(2.0 ** 96)
_PRODUCT_UNIT = tl.constexpr(2.0 ** -53)
_UNSCALE = tl.constexpr(2.0 ** 53)


@triton.jit
def _bits(word, mask: tl.constexpr):
    """word & mask read as an fp32: for a nibble mask 0xF * 16**j (j <= 4), exactly q * 16**j * 2**-149."""
    return (word & mask).to(tl.float32, bitcast=True)


@triton.jit
def _activation(x_ptr, perm_ptr, k, HAS_PERM: tl.constexpr):
    """x at packed rows k (fp32): act-order weights gather the columns through perm."""
    if HAS_PERM:
        k = tl.load(perm_ptr + k)
    return tl.load(x_ptr + k).to(tl.float32)


@triton.jit
def _tile_dot(x_ptr, perm_ptr, qweight_ptr, scales_ptr, zeros_ptr, k0, offs_n, n_ok, N, GROUP: tl.constexpr,
              HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
              write_q, write_s, write_z, write, WRITE: tl.constexpr):
    """[BLOCK_K // 8, BLOCK_N] fp32 terms whose column sums are x[k0:k0+BLOCK_K] @ W[k0:k0+BLOCK_K, offs_n].
    WRITE (the pool admits inside the step: CachedExperts.admits) and `write` (this expert was admitted into a pool
    slot in this step, ops/expert_claims.py): the tile's words and
    its group's scales (and zeros) are also stored at write_q / write_s / write_z, the slot's.

    The row reduction is left to the caller (once per program, not once per tile)."""
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    low = tl.load(qweight_ptr + words[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0)
    if WRITE:
        stored = tl.where(write, n_ok, False)   # (not n_ok & write: the interpreter makes that an int32 mask)
        tl.store(write_q + words[:, None] * N + offs_n[None, :], low, mask=stored[None, :])
        group = k0 // GROUP
        tl.store(write_s + group * N + offs_n, tl.load(scales_ptr + group * N + offs_n, mask=stored), mask=stored)
        if HAS_ZEROS:
            tl.store(write_z + group * N + offs_n, tl.load(zeros_ptr + group * N + offs_n, mask=stored), mask=stored)
    high = low >> 12  # rows 4..7 of each word to bits 4..19 (the sign bits this drags in are masked off)
    zero, scale = group_zero_scale(zeros_ptr, scales_ptr, k0 // GROUP, N, offs_n, n_ok, HAS_ZEROS, BLOCK_N)
    rows = 8 * words
    terms = tl.zeros((BLOCK_K // 8, BLOCK_N), tl.float32)
    row_sum = tl.zeros((BLOCK_K // 8,), tl.float32)
    mask = 0xF
    x_scale = _X_SCALE
    for j in tl.static_range(4):  # nibble j of `low`, and nibble j + 4 (at bits 4j + 4) of `high`
        x_low = _activation(x_ptr, perm_ptr, rows + j, HAS_PERM)
        x_high = _activation(x_ptr, perm_ptr, rows + 4 + j, HAS_PERM)
        row_sum += x_low + x_high
        terms += (x_low * x_scale)[:, None] * _bits(low, mask)
        terms += (x_high * (x_scale / 16))[:, None] * _bits(high, mask * 16)
        mask = mask * 16
        x_scale = x_scale / 16
    terms -= row_sum[:, None] * (zero * _PRODUCT_UNIT)[None, :]
    return terms * (scale * _UNSCALE)[None, :]


@triton.jit
def _sum_rows(ptr, first_row, n_rows, row_stride, offs, ok, ROWS: tl.constexpr):
    """The fixed-order sum of n_rows fp32 partials (rows first_row.. of a [*, row_stride] buffer) at offs."""
    rows = first_row + tl.arange(0, ROWS)
    mask = (tl.arange(0, ROWS) < n_rows)[:, None] & ok[None, :]
    parts = tl.load(ptr + rows[:, None] * row_stride + offs[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    return tl.sum(parts, axis=0)


@triton.jit
def _slot_weights(ids_ptr, token, slot, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, shared_q_ptr, shared_s_ptr,
                  shared_z_ptr, table_ptr, host_q_ptr, host_s_ptr, host_z_ptr, host_perm_ptr, K, N,
                  GROUP: tl.constexpr, TOP_K: tl.constexpr, CACHED: tl.constexpr):
    """The [K, N] weight a (token, slot) pair reads: its routed expert's in the stacks, or at slot TOP_K the shared
    expert's (SLOTS = TOP_K + 1) → (qweight, scales, zeros, perm) pointers, then where to write it and whether.
    CACHED (an expert cache): the stacks are a pool of slots, table[expert] the expert's slot, or -1, or ≤ -2 (just
    admitted into slot −t−2, ops/expert_claims.py); a missing expert is read from its row of the host store, in
    page-locked memory the GPU reads over PCIe — and an admitted one written into its slot as it is read."""
    write_row = tl.full((), -1, tl.int64)
    pool_q, pool_s, pool_z, pool_perm = qweight_ptr, scales_ptr, zeros_ptr, perm_ptr
    if slot == TOP_K:
        qweight, scales, zeros = shared_q_ptr, shared_s_ptr, shared_z_ptr
    else:
        expert = tl.load(ids_ptr + token * TOP_K + slot).to(tl.int64)
        if CACHED:
            row = tl.load(table_ptr + expert).to(tl.int64)
            if row < 0:
                qweight_ptr, scales_ptr, zeros_ptr, perm_ptr = host_q_ptr, host_s_ptr, host_z_ptr, host_perm_ptr
                write_row = tl.where(row <= -2, -row - 2, -1)
                row = expert
            expert = row
        qweight = qweight_ptr + expert * (K // 8) * N
        scales = scales_ptr + expert * (K // GROUP) * N
        zeros = zeros_ptr + expert * (K // GROUP) * N
        perm_ptr += expert * K
    at = tl.maximum(write_row, 0)
    return (qweight, scales, zeros, perm_ptr, pool_q + at * (K // 8) * N, pool_s + at * (K // GROUP) * N,
            pool_z + at * (K // GROUP) * N, pool_perm + at * K, write_row >= 0)


@triton.jit
def _unweighted(topk_weights_ptr, token, slot, TOP_K: tl.constexpr):
    """1 for a routed slot of weight exactly 0 (skipped: an expert-parallel choice of another rank), else 0 (an int:
    the interpreter takes no Python bool where the kernels combine it)."""
    weight = tl.load(topk_weights_ptr + token * TOP_K + tl.minimum(slot, TOP_K - 1)).to(tl.float32)
    return ((slot < TOP_K) & (weight == 0.0)).to(tl.int32)


@triton.jit
def _write_perm(perm_ptr, write_perm, write, K, HAS_PERM: tl.constexpr, WRITE: tl.constexpr):
    """An admitted expert's act-order permutation [K] into its slot (one program of its pair does it)."""
    if WRITE:
        if HAS_PERM:
            for k in range(0, K, 1024):
                offs = k + tl.arange(0, 1024)
                ok = tl.where(write, offs < K, False)
                tl.store(write_perm + offs, tl.load(perm_ptr + offs, mask=ok), mask=ok)


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, topk_weights_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, shared_q_ptr,
                    shared_s_ptr, shared_z_ptr, table_ptr, host_q_ptr, host_s_ptr, host_z_ptr, host_perm_ptr,
                    live_rows_ptr, h_ptr,
                    part_ptr, counter_ptr, H, I, k_per_split, GROUP: tl.constexpr,
                    TOP_K: tl.constexpr, SLOTS: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr,
                    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, CACHED: tl.constexpr, ADMITS: tl.constexpr,
                    LIVE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                    PDL: tl.constexpr):
    wait_for_inputs(PDL)
    pair, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    token, slot = pair // SLOTS, pair % SLOTS
    if LIVE_ROWS:
        if token >= tl.load(live_rows_ptr):   # a padding row: h unused (down skips it too), no counter touched
            return
    N = 2 * I
    qweight, scales, zeros, perm_ptr, write_q, write_s, write_z, write_perm, write = _slot_weights(
        ids_ptr, token, slot, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, shared_q_ptr, shared_s_ptr, shared_z_ptr,
        table_ptr, host_q_ptr, host_s_ptr, host_z_ptr, host_perm_ptr, H, N, GROUP, TOP_K, CACHED)
    unweighted = _unweighted(topk_weights_ptr, token, slot, TOP_K)
    write = tl.where(unweighted != 0, False, write)
    if (tile == 0) & (split == 0):
        _write_perm(perm_ptr, write_perm, write, H, HAS_PERM, ADMITS)
    x_ptr += token * H
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    gate = tl.zeros((BLOCK_K // 8, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_K // 8, BLOCK_N), tl.float32)
    k_start = split * k_per_split
    k_stop = tl.where(unweighted != 0, k_start, tl.minimum(k_start + k_per_split, H))   # skipped: nothing read
    for k0 in tl.range(k_start, k_stop, BLOCK_K, num_stages=NUM_STAGES):
        gate += _tile_dot(x_ptr, perm_ptr, qweight, scales, zeros, k0, offs_n, n_ok, N, GROUP,
                          HAS_ZEROS, HAS_PERM, BLOCK_K, BLOCK_N, write_q, write_s, write_z, write, ADMITS)
        up += _tile_dot(x_ptr, perm_ptr, qweight, scales, zeros, k0, I + offs_n, n_ok, N, GROUP,
                        HAS_ZEROS, HAS_PERM, BLOCK_K, BLOCK_N, write_q, write_s, write_z, write, ADMITS)
    g = tl.sum(gate, axis=0)
    u = tl.sum(up, axis=0)
    if SPLIT > 1:
        # part [M*slots, SPLIT, 2I]: gate partials, then up partials
        row = pair * SPLIT + split
        tl.store(part_ptr + row * N + offs_n, g, mask=n_ok)
        tl.store(part_ptr + row * N + I + offs_n, u, mask=n_ok)
        if arrive_last(counter_ptr + pair * tl.num_programs(1) + tile, SPLIT):
            g = _sum_rows(part_ptr, pair * SPLIT, SPLIT, N, offs_n, n_ok, SPLIT_P2)
            u = _sum_rows(part_ptr, pair * SPLIT, SPLIT, N, I + offs_n, n_ok, SPLIT_P2)
            tl.store(h_ptr + pair * I + offs_n, g * tl.sigmoid(g) * u, mask=n_ok)
    else:
        tl.store(h_ptr + pair * I + offs_n, g * tl.sigmoid(g) * u, mask=n_ok)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, topk_weights_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, shared_q_ptr,
                 shared_s_ptr, shared_z_ptr, table_ptr, host_q_ptr, host_s_ptr, host_z_ptr, host_perm_ptr,
                 live_rows_ptr, shared_logit_ptr, stride_logit, out_ptr, part_ptr, counter_ptr, H, I,
                 k_per_split, GROUP: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr, SPLIT: tl.constexpr,
                 PARTS_P2: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, CACHED: tl.constexpr,
                 ADMITS: tl.constexpr, LIVE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    pair, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    token, slot = pair // SLOTS, pair % SLOTS
    if LIVE_ROWS:
        if token >= tl.load(live_rows_ptr):   # a padding row: zeros, written by one program a tile
            if slot == 0 and split == 0:
                offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                tl.store(out_ptr + token * H + offs, tl.zeros((BLOCK_N,), tl.float32).to(out_ptr.dtype.element_ty),
                         mask=offs < H)
            return
    qweight, scales, zeros, perm_ptr, write_q, write_s, write_z, write_perm, write = _slot_weights(
        ids_ptr, token, slot, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, shared_q_ptr, shared_s_ptr, shared_z_ptr,
        table_ptr, host_q_ptr, host_s_ptr, host_z_ptr, host_perm_ptr, I, H, GROUP, TOP_K, CACHED)
    unweighted = _unweighted(topk_weights_ptr, token, slot, TOP_K)
    write = tl.where(unweighted != 0, False, write)
    if (tile == 0) & (split == 0):
        _write_perm(perm_ptr, write_perm, write, I, HAS_PERM, ADMITS)
    if slot == TOP_K:   # the shared expert, gated by sigmoid of its logit
        weight = tl.sigmoid(tl.load(shared_logit_ptr + token * stride_logit).to(tl.float32))
    else:
        weight = tl.load(topk_weights_ptr + token * TOP_K + slot).to(tl.float32)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), tl.float32)
    k_start = split * k_per_split
    k_stop = tl.where(unweighted != 0, k_start, tl.minimum(k_start + k_per_split, I))
    for k0 in tl.range(k_start, k_stop, BLOCK_K, num_stages=NUM_STAGES):
        acc += _tile_dot(h_ptr + pair * I, perm_ptr, qweight, scales, zeros, k0, offs_n, n_ok, H, GROUP,
                         HAS_ZEROS, HAS_PERM, BLOCK_K, BLOCK_N, write_q, write_s, write_z, write, ADMITS)
    y = tl.sum(acc, axis=0) * weight
    parts = SLOTS * SPLIT  # a constexpr
    if parts > 1:
        # part [M, slots*SPLIT, H]: one row per (slot, split) of the token
        tl.store(part_ptr + (pair * SPLIT + split) * H + offs_n, y, mask=n_ok)
        if arrive_last(counter_ptr + token * tl.num_programs(1) + tile, parts):
            y = _sum_rows(part_ptr, token * parts, parts, H, offs_n, n_ok, PARTS_P2)
            tl.store(out_ptr + token * H + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(out_ptr + token * H + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def _splits(k: int, block_k: int, wanted: int, programs: int, device: torch.device) -> tuple[int, int]:
    """(rows per split, number of splits) of a K of k rows; wanted 0: enough for PROGRAMS_PER_SM per SM."""
    steps = k // block_k
    if wanted == 0:
        wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms(device), programs)
    per = triton.cdiv(steps, max(1, min(wanted, steps)))
    return per * block_k, triton.cdiv(steps, per)


def moe_int4_decode(x, topk_ids, topk_weights, w_gate_up: Int4Weight, w_down: Int4Weight,
                    config: DecodeConfig | None = None, shared: SharedExpert | None = None,
                    cached: CachedExperts | None = None) -> torch.Tensor:
    """Same contract as ops.moe_int4.moe_int4_reference; x [M, H] bf16/fp16/fp32 on CUDA (or interpreted).
    `shared` runs as slot k of every token (its weights in the experts' forms: see shared_fits). `cached`: the
    stacks are an expert cache's pool of slots (ops.moe_int4.CachedExperts; with live_rows, the rows past it are
    skipped and come out zero)."""
    cfg = config or DEFAULT
    m, hidden = x.shape
    top_k = topk_ids.shape[1]
    slots = top_k + (shared is not None)
    inter = w_gate_up.qweight.shape[-1] // 2
    pairs = m * slots
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    device = x.device
    # Splits are fixed by the shapes (their M = 1 program count), so a token's bits do not depend on M.
    bk_up = block_k_for_group(cfg.block_k, w_gate_up.group_size)
    tiles_up = triton.cdiv(inter, cfg.block_n)
    per_up, split_up = _splits(hidden, bk_up, cfg.split_k, top_k * tiles_up, device)
    bk_down = block_k_for_group(cfg.block_k, w_down.group_size)
    down_block_n = cfg.down_block_n or cfg.block_n
    tiles_down = triton.cdiv(hidden, down_block_n)
    per_down, split_down = _splits(inter, bk_down, cfg.split_down, top_k * tiles_down, device)
    counters = arrival_counters(device, max(pairs * tiles_up, m * tiles_down))
    h = torch.empty(pairs, inter, dtype=torch.float32, device=device)
    out = torch.empty(m, hidden, dtype=x.dtype, device=device)
    part_up = torch.empty(pairs, split_up, 2 * inter, dtype=torch.float32, device=device) if split_up > 1 else h
    parts_down = slots * split_down
    part_down = torch.empty(m, parts_down, hidden, dtype=torch.float32, device=device) if parts_down > 1 else out
    launch = dict(NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **launch_options(x.device))

    def optional(w):  # zeros and perm, or a dummy pointer never read (HAS_ZEROS/HAS_PERM are constexprs)
        return (w.scales if w.zeros is None else w.zeros, w.qweight if w.perm is None else w.perm,
                dict(HAS_ZEROS=w.zeros is not None, HAS_PERM=w.perm is not None))

    def shared_pointers(w):   # the routed weights stand in (never read) without a shared expert
        s = w if shared is None else (shared.gate_up if w is w_gate_up else shared.down)
        return s.qweight, s.scales, optional(s)[0]

    def cache_pointers(w):   # the table and the host store's rows, or the pool standing in (never read)
        if cached is None:
            return (ids, w.qweight, w.scales, *optional(w)[:2])
        host = cached.gate_up if w is w_gate_up else cached.down
        zeros, perm, _ = optional(host)
        return cached.table, host.qweight, host.scales, zeros, perm

    if shared is not None:
        assert shared_fits(w_gate_up, w_down, shared.gate_up, shared.down), "see shared_fits"
    skip_padding = cached is not None and cached.live_rows is not None
    admits = cached is not None and cached.admits     # the write code only where entries may be ≤ -2
    live_rows = cached.live_rows if skip_padding else ids    # a dummy pointer, never read without LIVE_ROWS
    zeros, perm, flags = optional(w_gate_up)
    routing_weights = topk_weights.reshape(-1).contiguous()
    _gate_up_kernel[(pairs, tiles_up, split_up)](
        x, ids, routing_weights, w_gate_up.qweight, w_gate_up.scales, zeros, perm, *shared_pointers(w_gate_up),
        *cache_pointers(w_gate_up), live_rows, h, part_up, counters, hidden, inter, per_up, GROUP=w_gate_up.group_size,
        TOP_K=top_k, SLOTS=slots, SPLIT=split_up, SPLIT_P2=triton.next_power_of_2(split_up), CACHED=cached is not None,
        ADMITS=admits, LIVE_ROWS=skip_padding, BLOCK_N=cfg.block_n, BLOCK_K=bk_up, **flags, **launch)
    zeros, perm, flags = optional(w_down)
    logit = shared.logit if shared is not None else topk_weights
    _down_kernel[(pairs, tiles_down, split_down)](
        h, ids, routing_weights, w_down.qweight, w_down.scales, zeros, perm,
        *shared_pointers(w_down), *cache_pointers(w_down), live_rows, logit, logit.stride(0), out, part_down, counters,
        hidden, inter, per_down, GROUP=w_down.group_size, TOP_K=top_k, SLOTS=slots, SPLIT=split_down,
        PARTS_P2=triton.next_power_of_2(parts_down), CACHED=cached is not None, ADMITS=admits, LIVE_ROWS=skip_padding,
        BLOCK_N=down_block_n, BLOCK_K=bk_down, **flags, **launch)
    return out

