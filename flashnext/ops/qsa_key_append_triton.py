"""QSA decode key bookkeeping in one kernel, one program per row (reference: ops/qsa_key_append.py).

The RoPE tables are computed in the kernel from inv_freq (fp32 angle, cos/sin rounded to the keys' dtype as
RotaryEmbedding rounds them), and every 16-bit rounding of the reference happens at the same point.

CHAINED (`chained=True`): the rows are one sequence's consecutive tokens (a chained decode batch,
models/decode_batch.py), which the reference appends one row after the other. Here every row's program at once: a
row that completes its block pools it from the rows of the chain and, for the block's positions before the chain,
from the ring as it was; the others return at once, writing no key (the sequential form writes their incomplete
blocks' rows, which nothing reads before a later row completes them). A second launch (RING), of a program for each of
the last RATIO rows, then leaves in the ring what the sequential form leaves: each offset's raw key from the last row
with that offset, other offsets as they were — after the first launch's reads, which a single launch would race with."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.ops.rounding import round_to_dtype


@triton.jit(do_not_specialize=["rows"])
def _qsa_key_append_kernel(raw_ptr, ring_ptr, slots_ptr, pos_ptr, table_ptr, keys_ptr, w_ptr, inv_freq_ptr,
                           stride_raw, stride_table, rows, D, R, eps, RATIO: tl.constexpr, PER_PAGE: tl.constexpr,
                           BLOCK_D: tl.constexpr, CHAINED: tl.constexpr, RING: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    if RING:   # launched for the last RATIO rows only (the last row of each offset)
        b += tl.maximum(rows - RATIO, 0)
    dtype = keys_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    slot = tl.load(slots_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    offset = pos % RATIO
    if CHAINED and not RING:
        if offset != RATIO - 1:   # completes no block: no key to write
            return
    half = R // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    rotating = offs < R
    ring_row = ring_ptr + slot * (RATIO - 1) * D
    raw = tl.load(raw_ptr + b * stride_raw + offs, mask=ok, other=0.0).to(tl.float32)
    if RING:   # a chained batch's second launch: the last row of each offset joins the ring
        joins = (offs * 0 + offset) < RATIO - 1
        tl.store(ring_row + offset * D + offs, raw.to(dtype), mask=ok & joins)
        return
    raw_p = tl.load(raw_ptr + b * stride_raw + partner, mask=rotating, other=0.0).to(tl.float32)
    total, total_p = raw * 0.0, raw_p * 0.0
    if CHAINED:   # the block's positions from the chain's first on are rows of it, the earlier ones in the ring
        first = tl.load(pos_ptr).to(tl.int64)
        for j in tl.static_range(RATIO):
            q = pos - offset + j
            # positions past the row's own (a row that completes no block: no key written) read nothing
            in_chain = ((offs * 0 + q) >= first) & ((offs * 0 + q) <= pos)
            row = tl.maximum(b - (pos - q), 0)
            total += tl.load(raw_ptr + row * stride_raw + offs, mask=ok & in_chain, other=0.0).to(tl.float32)
            total_p += tl.load(raw_ptr + row * stride_raw + partner, mask=rotating & in_chain, other=0.0).to(tl.float32)
            if j < RATIO - 1:   # the ring holds the block's first RATIO - 1 positions
                before = (offs * 0 + q) < first
                total += tl.load(ring_row + j * D + offs, mask=ok & before, other=0.0).to(tl.float32)
                total_p += tl.load(ring_row + j * D + partner, mask=rotating & before, other=0.0).to(tl.float32)
        pooled = round_to_dtype(total / RATIO, dtype)
        pooled_p = round_to_dtype(total_p / RATIO, dtype)
    else:
        for j in tl.static_range(RATIO - 1):
            total += tl.load(ring_row + j * D + offs, mask=ok, other=0.0).to(tl.float32)
            total_p += tl.load(ring_row + j * D + partner, mask=rotating, other=0.0).to(tl.float32)
        pooled = round_to_dtype((total + raw) / RATIO, dtype)
        pooled_p = round_to_dtype((total_p + raw_p) / RATIO, dtype)
    rstd = tl.rsqrt(tl.sum(pooled * pooled, axis=0) / D + eps)
    y = round_to_dtype(pooled * rstd * (1.0 + tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)), dtype)
    y_p = round_to_dtype(pooled_p * rstd * (1.0 + tl.load(w_ptr + partner, mask=rotating, other=0.0).to(tl.float32)), dtype)
    angle = (pos - offset).to(tl.float32) * tl.load(inv_freq_ptr + offs % half, mask=rotating, other=0.0)
    cos = round_to_dtype(tl.cos(angle), dtype)
    sin = round_to_dtype(tl.sin(angle), dtype)
    rotated = tl.where(offs < half, -y_p, y_p)
    key = tl.where(rotating, round_to_dtype(y * cos, dtype) + round_to_dtype(rotated * sin, dtype), y)
    block = pos // RATIO
    page = tl.load(table_ptr + b * stride_table + block // PER_PAGE).to(tl.int64)
    complete = (offs * 0 + offset) == RATIO - 1
    tl.store(keys_ptr + (page * PER_PAGE + block % PER_PAGE) * D + offs, key.to(dtype),
             mask=ok & complete if CHAINED else ok)
    if not CHAINED:   # the raw key joins the ring unless its block is complete now (the ring starts over next step)
        tl.store(ring_row + tl.minimum(offset, RATIO - 2) * D + offs, raw.to(dtype), mask=ok & ~complete)


def qsa_key_append_triton(raw, ring, slots, positions, block_table, index_keys, norm_weight, eps, inv_freq,
                          chained: bool = False) -> None:
    """`chained`: the rows are one sequence's consecutive tokens (see the module docstring): two launches."""
    rows, dim = raw.shape
    assert raw.stride(-1) == 1 and ring.is_contiguous() and index_keys.is_contiguous() and block_table.stride(-1) == 1
    if not rows:
        return
    args = (raw, ring, slots, positions, block_table, index_keys, norm_weight,
            inv_freq.to(device=raw.device, dtype=torch.float32), raw.stride(0), block_table.stride(0), rows, dim,
            2 * inv_freq.numel(), eps)
    constants = dict(RATIO=ring.shape[1] + 1, PER_PAGE=index_keys.shape[1], BLOCK_D=triton.next_power_of_2(dim),
                     CHAINED=chained, num_warps=1, **launch_options(raw.device))
    _qsa_key_append_kernel[(rows,)](*args, RING=False, **constants)
    if chained:
        _qsa_key_append_kernel[(min(rows, constants["RATIO"]),)](*args, RING=True, **constants)
