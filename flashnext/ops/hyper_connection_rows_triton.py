"""The hyper-connection mix for decode batches of up to 16 rows on tensor cores (reference: ops/hyper_connection.py).

The mix kernels of ops/hyper_connection_triton.py multiply and sum in fp32 registers row by row, so their cost grows
~4.5–6 µs a row (BENCHMARKS.md session 9); cuBLAS reads each weight once for all rows but takes ~8 launches with the
norm and the elementwise steps around its two GEMMs. These two kernels read each weight once for all rows, with the
rows as the M = 16 side of tl.dot:
- `_rows_down_kernel`, grid (tiles of 16 rows of w_down then w_inject, hc streams): a program takes its stream's
  sum of squares for every row of h (one pass over the stream), then the normed stream, rounded to h's dtype as
  the reference's norm rounds it, tile by tile against its weight rows: its stream's partial sums, [16 rows of h,
  its weight rows] of a [hc, 16, R (+ hc)] buffer. The first row tile stores the streams' sums of squares.
- `_rows_up_kernel`, grid (column tiles of H): a program sums the stream partials in a fixed order (deterministic)
  and rounds as the reference (the linear's output, / hc, silu) into the mix vector of every row, the low rank as
  one K tile; then for each stream the up logits of its columns (mix @ w_up), sigmoid, times the normed stream,
  summed over the streams and averaged; program 0 also stores the injection weights.
bf16 operands go to the tensor cores with fp32 accumulation; fp32 ones take IEEE dots (the exactness tests).
After a block whose injection is pending (decode), hc_mix_injected injects first: three launches, not two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.hyper_connection_triton import down_inject_rows, mix_buffers, sigmoid
from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.ops.rounding import round_to_dtype

MAX_ROWS = 16      # the dots' M side
BLOCK_R = 16       # weight rows a down program
BLOCK_K = 64       # the down GEMM's K tile (along a stream)
BLOCK_H = 32       # block-input columns an up program (the up GEMM's K, the low rank, is one tile)


@triton.jit
def _rows_down_kernel(x_ptr, nw_ptr, wd_ptr, wi_ptr, part_ptr, sumsq_ptr, N, H, R, stride_x, eps,
                      HC: tl.constexpr, HAS_INJECT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pid_r, stream = tl.program_id(0), tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    rows, offs_r, r_ok, w_rows = down_inject_rows(wd_ptr, wi_ptr, R, H, HC, HAS_INJECT, BLOCK_R)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < N
    x_rows = x_ptr + offs_m[:, None] * stride_x + stream * H
    wait_for_inputs(PDL)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k < H)[None, :], other=0.0).to(tl.float32)
        sumsq += tl.sum(xv * xv, axis=1)
    if pid_r == 0:
        tl.store(sumsq_ptr + offs_m * HC + stream, sumsq, mask=m_ok)
    rstd = tl.math.rsqrt(sumsq / H + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        xv = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        scale = 1.0 + tl.load(nw_ptr + stream * H + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        normed = ((xv * rstd[:, None]) * scale[None, :]).to(dtype)
        w = tl.load(w_rows[None, :] + stream * H + offs_k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.dot(normed, w.to(dtype), input_precision=DOT_PRECISION)
    tl.store(part_ptr + (stream * BLOCK_M + offs_m[:, None]) * rows + offs_r[None, :], acc,
             mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _down_sum(part_ptr, offs_m, m_ok, rows, offs_c, c_ok, HC: tl.constexpr, BLOCK_M: tl.constexpr):
    """Columns offs_c of the down/inject GEMM for every row: the stream partials summed in stream order."""
    total = tl.zeros([BLOCK_M, offs_c.shape[0]], dtype=tl.float32)
    for s in tl.static_range(HC):
        total += tl.load(part_ptr + (s * BLOCK_M + offs_m[:, None]) * rows + offs_c[None, :],
                         mask=m_ok[:, None] & c_ok[None, :], other=0.0)
    return total


@triton.jit
def _rows_up_kernel(x_ptr, nw_ptr, part_ptr, sumsq_ptr, wu_ptr, out_ptr, inj_ptr, N, H, R, stride_x, stride_o, eps,
                    HC: tl.constexpr, HAS_INJECT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_KR: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    PDL: tl.constexpr):
    pid_h = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    rows = R + HC if HAS_INJECT else R
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < N
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    wait_for_inputs(PDL)
    if HAS_INJECT:
        if pid_h == 0:   # 2·sigmoid(linear / hc), each step rounded as the reference
            offs_s = tl.arange(0, BLOCK_S)
            s_ok = offs_s < HC
            v = round_to_dtype(round_to_dtype(_down_sum(part_ptr, offs_m, m_ok, rows, R + offs_s, s_ok, HC, BLOCK_M),
                                              dtype) / HC, dtype)
            tl.store(inj_ptr + offs_m[:, None] * HC + offs_s[None, :], 2.0 * round_to_dtype(sigmoid(v), dtype),
                     mask=m_ok[:, None] & s_ok[None, :])
    # the mix vector of every row, once: silu(linear / hc), each step rounded as the reference; zero past R
    offs_kr = tl.arange(0, BLOCK_KR)
    kr_ok = offs_kr < R
    v = round_to_dtype(round_to_dtype(_down_sum(part_ptr, offs_m, m_ok, rows, offs_kr, kr_ok, HC, BLOCK_M), dtype)
                       / HC, dtype)
    mix = tl.where(kr_ok[None, :], round_to_dtype(v * sigmoid(v), dtype), 0.0).to(dtype)
    total = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    for s in tl.static_range(HC):
        wu = tl.load(wu_ptr + (s * H + offs_h[None, :]) * R + offs_kr[:, None], mask=kr_ok[:, None] & h_ok[None, :],
                     other=0.0)
        up = tl.dot(mix, wu.to(dtype), input_precision=DOT_PRECISION)
        gate = round_to_dtype(sigmoid(round_to_dtype(up, dtype)), dtype)
        sumsq = tl.load(sumsq_ptr + offs_m * HC + s, mask=m_ok, other=1.0)
        rstd = tl.math.rsqrt(sumsq / H + eps)
        xv = tl.load(x_ptr + offs_m[:, None] * stride_x + s * H + offs_h[None, :], mask=m_ok[:, None] & h_ok[None, :],
                     other=0.0).to(tl.float32)
        scale = 1.0 + tl.load(nw_ptr + s * H + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        normed = round_to_dtype((xv * rstd[:, None]) * scale[None, :], dtype)
        total += round_to_dtype(gate * normed, dtype)
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_h[None, :], total / HC, mask=m_ok[:, None] & h_ok[None, :])


def hc_mix_rows_triton(h: torch.Tensor, norm_weight: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor,
                       w_inject: torch.Tensor | None, hc: int, hidden: int,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [N ≤ 16, hc·H] → (block input [N, H], injection weights [N, hc] or None); see ops/hyper_connection.py."""
    n, lowrank = h.shape[0], w_down.shape[0]
    assert n <= MAX_ROWS
    h, block_input, inject, rows, partials, sumsq = mix_buffers(h, norm_weight, w_down, w_up, w_inject, hc, hidden,
                                                                MAX_ROWS)
    if n == 0:
        return block_input, inject
    precision, pdl = "ieee" if h.dtype == torch.float32 else None, launch_options(h.device)
    _rows_down_kernel[(triton.cdiv(rows, BLOCK_R), hc)](
        h, norm_weight, w_down, w_inject if w_inject is not None else w_down, partials, sumsq, n, hidden, lowrank,
        h.stride(0), eps, HC=hc, HAS_INJECT=w_inject is not None, BLOCK_M=MAX_ROWS, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
        DOT_PRECISION=precision, num_warps=4, **pdl)
    _rows_up_kernel[(triton.cdiv(hidden, BLOCK_H),)](
        h, norm_weight, partials, sumsq, w_up, block_input, inject if inject is not None else block_input, n, hidden,
        lowrank, h.stride(0), block_input.stride(0), eps, HC=hc, HAS_INJECT=w_inject is not None, BLOCK_M=MAX_ROWS,
        BLOCK_S=triton.next_power_of_2(hc), BLOCK_H=BLOCK_H, BLOCK_KR=max(16, triton.next_power_of_2(lowrank)),
        DOT_PRECISION=precision, num_warps=4, **pdl)
    return block_input, inject
