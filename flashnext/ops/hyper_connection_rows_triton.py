"""The hyper-connection mix of several rows on tensor cores (reference: ops/hyper_connection.py): decode batches of
5–16 rows, and up to FLASHNEXT_HC_DECODE_MAX_ROWS rows of a prefill chunk (two launches a mix, fewer than the
cuBLAS path's).

The one-row kernels (ops/hyper_connection_triton.py) keep each program's weights in registers and loop over the rows,
~4.5–6 µs a row (H200, session 13: see ops/hyper_connection.py and BENCHMARKS.md's table); cuBLAS reads
each weight once for all rows but with the norm and elementwise steps around its two GEMMs takes ~27 µs at any
2–16 rows. Here every weight is read once for every ROWS_TILE (16) rows, the M side of tl.dot, and no program loops:
- `_rows_down_kernel`, grid (tiles of 16 rows of w_down then w_inject, hc streams, splits of a stream's H × tiles of
  16 rows of h):
  a program loads its [BLOCK_K, 16] weight tile before it waits for its input (ops/pdl.py), then the rows'
  stream slice (injecting the previous block's output first when one is pending, as hc_inject rounds it; the
  first row tile writes the injected streams out), its sums of squares and one dot of the slice times
  (1 + norm weight), rounded to the dtype for the tensor cores. The stream's rstd is a scalar of that dot, so
  it is applied later. Each program stores its partials and counts itself in (ops/arrival.py); the last of a
  row tile adds them in a fixed order (deterministic) — per stream, times its rstd — and rounds as the
  reference does (the linear's output, / hc; then silu for the mix vector, 2·sigmoid for the injection weights).
  Row tile 0's last program also stores every row's rstd per stream.
- `_rows_up_kernel`, grid (column tiles of H, tiles of 16 rows of h): a program loads its columns' up-weight rows of every stream
  ([low rank, hc × BLOCK_H]) before it waits, then one dot of the rows' mix vectors with them, sigmoid, times
  the normed streams (rounded as the reference's norm), summed over the streams and averaged.
The departure from the reference: the normed stream that enters the down GEMM is x times (1 + norm weight) rounded to
the dtype (the tensor cores' operand), its rstd applied after the dot, where the reference rounds x · rstd · (1 +
norm weight) (the one-row kernels keep x · (1 + norm weight) in fp32). bf16 operands go to the tensor cores with fp32 accumulation; fp32 ones take IEEE dots (the exactness
tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.ops.arrival import arrival_counters, arrive_last
from flashnext.ops.hyper_connection_triton import down_inject_rows, mix_outputs, sigmoid
from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.ops.rounding import round_to_dtype

ROWS_TILE = 16     # rows of h a program takes: the dots' M side


@dataclass(frozen=True)
class RowsConfig:
    block_r: int = 16      # down|inject weight rows a down program (the down dot's N)
    block_k: int = 256     # a down program's slice of a stream (the down dot's K: one dot, no loop)
    block_h: int = 4       # block-input columns an up program (hc × block_h columns: the up dot's N, at least 16)
    warps_down: int = 4
    warps_up: int = 4


# Measured in the decode step, not alone: the H200 sweep of one mix repeated (scripts/gpu_hyper_connection.py
# --sweep-rows, session 13: its weights L2-warm, no pending injection) found 32 × 1024 down tiles at 8 warps and
# 16-column up programs at 2 warps at 14.4 µs against these tiles' 22.9–24.4 — and in the captured Flash-Next step
# at 64K they took ~330 + 300 µs a mix at 8 rows, the profile kept (the step 38.7 / 40.6 / 44.4 ms at 2 / 4 / 8 rows against 8.3 / 10.2 /
# 14.1 with these; likely register spills, which the warm L2 hid). Tune with `gpu_decode.py --batch`.
DEFAULT_ROWS_CONFIG = RowsConfig()


@triton.jit
def _rows_down_kernel(x_ptr, nw_ptr, wd_ptr, wi_ptr, bo_ptr, pw_ptr, hout_ptr, part_ptr, sumsq_ptr, counter_ptr,
                      mix_ptr, rstd_ptr, inj_ptr, N, H, R, stride_x, stride_bo, stride_pw, stride_hout, eps,
                      HC: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HAS_INJECT: tl.constexpr,
                      HAS_PENDING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pid_r, stream = tl.program_id(0), tl.program_id(1)
    split, m_tile = tl.program_id(2) % SPLITS, tl.program_id(2) // SPLITS
    tile = m_tile * tl.num_programs(0) + pid_r        # this row tile of this tile of h's rows: its partials, counter
    dtype = x_ptr.dtype.element_ty
    rows, offs_r, r_ok, w_rows = down_inject_rows(wd_ptr, wi_ptr, R, H, HC, HAS_INJECT, BLOCK_R)
    offs_k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < H
    w = tl.load(w_rows[None, :] + stream * H + offs_k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
    scale = 1.0 + tl.load(nw_ptr + stream * H + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < N
    mk_ok = m_ok[:, None] & k_ok[None, :]
    wait_for_inputs(PDL)
    xv = tl.load(x_ptr + offs_m[:, None] * stride_x + stream * H + offs_k[None, :], mask=mk_ok,
                 other=0.0).to(tl.float32)
    if HAS_PENDING:   # the previous block's injection first: h + weight × block output, as hc_inject rounds it
        bo = tl.load(bo_ptr + offs_m[:, None] * stride_bo + offs_k[None, :], mask=mk_ok, other=0.0).to(tl.float32)
        weight = tl.load(pw_ptr + offs_m * stride_pw + stream, mask=m_ok, other=0.0).to(tl.float32)
        injected = (xv + round_to_dtype(bo * weight[:, None], dtype)).to(dtype)
        if pid_r == 0:
            tl.store(hout_ptr + offs_m[:, None] * stride_hout + stream * H + offs_k[None, :], injected, mask=mk_ok)
        xv = injected.to(tl.float32)
    part = tl.dot((xv * scale[None, :]).to(dtype), w.to(dtype), input_precision=DOT_PRECISION)  # [M, BLOCK_R]
    # this program's place among its tile's hc × SPLITS: partials [m tiles · row tiles, hc, SPLITS, BLOCK_M, BLOCK_R],
    # sums of squares [m tiles · row tiles, hc, SPLITS, BLOCK_M]
    at = (tile * HC + stream) * SPLITS + split
    offs_c = tl.arange(0, BLOCK_R)
    offs_t = tl.arange(0, BLOCK_M)     # the rows of h within the tile
    tl.store(part_ptr + (at * BLOCK_M + offs_t[:, None]) * BLOCK_R + offs_c[None, :], part)
    tl.store(sumsq_ptr + at * BLOCK_M + offs_t, tl.sum(xv * xv, axis=1))
    if arrive_last(counter_ptr + tile, HC * SPLITS):
        offs_p = tl.arange(0, SPLITS_P2)
        p_ok = offs_p < SPLITS
        total = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
        for s in tl.static_range(HC):
            first = (tile * HC + s) * SPLITS
            sq = tl.load(sumsq_ptr + (first + offs_p[:, None]) * BLOCK_M + offs_t[None, :], mask=p_ok[:, None],
                         other=0.0, cache_modifier=".cg")
            rstd = tl.math.rsqrt(tl.sum(sq, axis=0) / H + eps)                                       # [M]
            parts = tl.load(part_ptr + ((first + offs_p[:, None, None]) * BLOCK_M + offs_t[None, :, None]) * BLOCK_R
                            + offs_c[None, None, :], mask=p_ok[:, None, None], other=0.0, cache_modifier=".cg")
            total += tl.sum(parts, axis=0) * rstd[:, None]
            if pid_r == 0:
                tl.store(rstd_ptr + offs_m * HC + s, rstd, mask=m_ok)
        v = round_to_dtype(round_to_dtype(total, dtype) / HC, dtype)
        mix_rows = offs_r < R
        tl.store(mix_ptr + offs_m[:, None] * R + offs_r[None, :], round_to_dtype(v * sigmoid(v), dtype),
                 mask=m_ok[:, None] & mix_rows[None, :])
        if HAS_INJECT:
            tl.store(inj_ptr + offs_m[:, None] * HC + (offs_r - R)[None, :], 2.0 * round_to_dtype(sigmoid(v), dtype),
                     mask=m_ok[:, None] & tl.where(mix_rows, False, r_ok)[None, :])


@triton.jit
def _rows_up_kernel(x_ptr, nw_ptr, mix_ptr, rstd_ptr, wu_ptr, out_ptr, N, H, R, stride_x, stride_o,
                    HC: tl.constexpr, HC_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_KR: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pid_h = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    # column j of the program's [hc_p2 × BLOCK_H] is stream j // BLOCK_H's block-input column offs_h[j % BLOCK_H]
    offs_j = tl.arange(0, HC_P2 * BLOCK_H)
    stream = offs_j // BLOCK_H
    col = pid_h * BLOCK_H + offs_j % BLOCK_H
    j_ok = (stream < HC) & (col < H)
    width = stream * H + col                                                       # in the hc·H streams
    offs_kr = tl.arange(0, BLOCK_KR)
    kr_ok = offs_kr < R
    wu = tl.load(wu_ptr + width[None, :] * R + offs_kr[:, None], mask=kr_ok[:, None] & j_ok[None, :], other=0.0)
    scale = 1.0 + tl.load(nw_ptr + width, mask=j_ok, other=0.0).to(tl.float32)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < N
    mj_ok = m_ok[:, None] & j_ok[None, :]
    wait_for_inputs(PDL)
    mix = tl.load(mix_ptr + offs_m[:, None] * R + offs_kr[None, :], mask=m_ok[:, None] & kr_ok[None, :], other=0.0)
    up = round_to_dtype(tl.dot(mix.to(dtype), wu.to(dtype), input_precision=DOT_PRECISION), dtype)     # [M, J]
    gate = round_to_dtype(sigmoid(up), dtype)
    rstd = tl.load(rstd_ptr + offs_m[:, None] * HC + stream[None, :], mask=mj_ok, other=0.0)
    xv = tl.load(x_ptr + offs_m[:, None] * stride_x + width[None, :], mask=mj_ok, other=0.0).to(tl.float32)
    normed = round_to_dtype(xv * rstd * scale[None, :], dtype)
    terms = tl.where(mj_ok, round_to_dtype(gate * normed, dtype), 0.0)
    total = tl.sum(tl.reshape(terms, (BLOCK_M, HC_P2, BLOCK_H)), axis=1)                         # [M, BLOCK_H]
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_h[None, :], total / HC,
             mask=m_ok[:, None] & (offs_h < H)[None, :])


def hc_mix_rows_triton(h: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None, norm_weight: torch.Tensor,
                       w_down: torch.Tensor, w_up: torch.Tensor, w_inject: torch.Tensor | None, hc: int, hidden: int,
                       eps: float, config: RowsConfig = DEFAULT_ROWS_CONFIG,
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """h [N, hc·H] (+ a pending injection: (block output [N, H], weights [N, hc]), which the down kernel does on its
    way in) → (block input [N, H], injection weights [N, hc] or None, the streams mixed: h injected, or h). The rows
    go ROWS_TILE at a time (a grid axis: each tile reads the weights again)."""
    n, lowrank = h.shape[0], w_down.shape[0]
    assert all(b & (b - 1) == 0 for b in (config.block_r, config.block_k, config.block_h)), "tiles: powers of two"
    h, block_output, weights, block_input, inject, injected, rows = mix_outputs(h, pending, norm_weight, w_down, w_up,
                                                                                w_inject, hc, hidden)
    if n == 0:
        return block_input, inject, injected
    m_tiles = triton.cdiv(n, ROWS_TILE)
    tiles, splits = m_tiles * triton.cdiv(rows, config.block_r), triton.cdiv(hidden, config.block_k)
    per_program = ROWS_TILE * (config.block_r + 1)   # partials and sums of squares
    padded = m_tiles * ROWS_TILE
    work = torch.empty(tiles * hc * splits * per_program + padded * (lowrank + hc), dtype=torch.float32,
                       device=h.device)
    parts_end = tiles * hc * splits * ROWS_TILE * config.block_r
    sums_end = parts_end + tiles * hc * splits * ROWS_TILE
    partials, sumsq = work[:parts_end], work[parts_end:sums_end]
    mix, rstd = work[sums_end:sums_end + padded * lowrank], work[sums_end + padded * lowrank:]
    precision, pdl = "ieee" if h.dtype == torch.float32 else None, launch_options(h.device)
    _rows_down_kernel[(tiles // m_tiles, hc, splits * m_tiles)](
        h, norm_weight, w_down, w_inject if w_inject is not None else w_down, block_output, weights, injected, partials,
        sumsq, arrival_counters(h.device, tiles), mix, rstd, inject if inject is not None else block_input, n, hidden,
        lowrank, h.stride(0), block_output.stride(0), weights.stride(0), injected.stride(0), eps, HC=hc,
        SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), HAS_INJECT=w_inject is not None,
        HAS_PENDING=pending is not None, BLOCK_M=ROWS_TILE, BLOCK_R=config.block_r, BLOCK_K=config.block_k,
        DOT_PRECISION=precision, num_warps=config.warps_down, **pdl)
    hc_p2 = triton.next_power_of_2(hc)
    block_h = max(config.block_h, 16 // hc_p2)
    _rows_up_kernel[(triton.cdiv(hidden, block_h), m_tiles)](
        injected, norm_weight, mix, rstd, w_up, block_input, n, hidden, lowrank, injected.stride(0),
        block_input.stride(0), HC=hc, HC_P2=hc_p2, BLOCK_M=ROWS_TILE, BLOCK_H=block_h,
        BLOCK_KR=max(16, triton.next_power_of_2(lowrank)), DOT_PRECISION=precision, num_warps=config.warps_up, **pdl)
    return block_input, inject, injected
