"""QSA decode key bookkeeping in one kernel, one program per row (reference: ops/qsa_key_append.py).

The RoPE tables are computed in the kernel from inv_freq (fp32 angle, cos/sin rounded to the keys' dtype as
RotaryEmbedding rounds them), and every 16-bit rounding of the reference happens at the same point."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.ops.rounding import round_to_dtype


@triton.jit
def _qsa_key_append_kernel(raw_ptr, ring_ptr, slots_ptr, pos_ptr, table_ptr, keys_ptr, w_ptr, inv_freq_ptr,
                           stride_raw, stride_table, D, R, eps, RATIO: tl.constexpr, PER_PAGE: tl.constexpr,
                           BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    dtype = keys_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    slot = tl.load(slots_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    offset = pos % RATIO
    half = R // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    rotating = offs < R
    raw = tl.load(raw_ptr + b * stride_raw + offs, mask=ok, other=0.0).to(tl.float32)
    raw_p = tl.load(raw_ptr + b * stride_raw + partner, mask=rotating, other=0.0).to(tl.float32)
    total, total_p = raw * 0.0, raw_p * 0.0
    ring_row = ring_ptr + slot * (RATIO - 1) * D
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
    tl.store(keys_ptr + (page * PER_PAGE + block % PER_PAGE) * D + offs, key.to(dtype), mask=ok)
    # The raw key joins the ring unless its block is complete now (then the ring starts over next step).
    joins = (offs * 0 + offset) < RATIO - 1
    tl.store(ring_row + tl.minimum(offset, RATIO - 2) * D + offs, raw.to(dtype), mask=ok & joins)


def qsa_key_append_triton(raw, ring, slots, positions, block_table, index_keys, norm_weight, eps, inv_freq) -> None:
    rows, dim = raw.shape
    assert raw.stride(-1) == 1 and ring.is_contiguous() and index_keys.is_contiguous() and block_table.stride(-1) == 1
    if rows:
        _qsa_key_append_kernel[(rows,)](raw, ring, slots, positions, block_table, index_keys, norm_weight,
                                        inv_freq.to(device=raw.device, dtype=torch.float32), raw.stride(0),
                                        block_table.stride(0),
                                        dim, 2 * inv_freq.numel(), eps, RATIO=ring.shape[1] + 1,
                                        PER_PAGE=index_keys.shape[1], BLOCK_D=triton.next_power_of_2(dim), num_warps=1,
                                        **launch_options(raw.device))
