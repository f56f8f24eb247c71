"""Triton hyper-connection mix (two launches) and inject (one), for decode (N ≤ 16 rows; any N is correct).

The mix reads two [R, hc·H] weights (2 × 6.5 MB at Flash-Next's shapes) and little else, so each launch
must spread its weight over the whole GPU:
- `_hc_down_kernel`, grid (row tiles of the R down rows + hc inject rows, K splits, row blocks): each
  program recomputes the rms of the one stream its K range lies in (N·H elements, from L2: cheaper than a
  launch), normalises its K range, rounds it to h's dtype as the norm does, and multiplies it with its
  [BLOCK_R, K range] weight tile in fp32. Partials go to a workspace; the last program of a row tile to
  arrive (an atomic counter) adds them in K order — deterministic — and applies /hc, silu (down rows) or
  2·sigmoid (inject rows). No third launch and no fp32 atomics on the result.
- `_hc_up_kernel`, grid (column tiles of H, row blocks): for each stream the up GEMV of its [BLOCK_H, R]
  weight rows, sigmoid, times the normed stream (recomputed from h and the stored rms), summed over the
  streams: block input columns in one pass.
Both GEMVs are fp32 multiply-and-sum in registers (no tensor cores at N ≤ 8). Values are rounded to h's
dtype wherever the reference rounds, so bf16 results differ from it only by fp32 summation order.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.ops.arrival import arrival_counters
from flashnext.ops.rounding import round_to_dtype


@triton.jit
def _sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def _hc_down_kernel(x_ptr, nw_ptr, wd_ptr, wi_ptr, part_ptr, count_ptr, mix_ptr, inj_ptr, rms_ptr,
                    N, H, R, stride_x, k_per_split, splits, eps,
                    HC: tl.constexpr, HAS_INJECT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_RMS: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty
    K = HC * H
    rows = R + HC if HAS_INJECT else R
    stream = pid_k // splits
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < N
    x_rows = x_ptr + offs_m[:, None] * stride_x

    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_RMS):
        offs = k0 + tl.arange(0, BLOCK_RMS)
        xv = tl.load(x_rows + stream * H + offs[None, :], mask=mask_m[:, None] & (offs < H)[None, :], other=0.0)
        xv = xv.to(tl.float32)
        sumsq += tl.sum(xv * xv, axis=1)
    rstd = tl.math.rsqrt(sumsq / H + eps)
    if (pid_r == 0) & (pid_k % splits == 0):
        tl.store(rms_ptr + offs_m * HC + stream, rstd, mask=mask_m)

    # Rows [0, R) are w_down's, rows [R, R + hc) w_inject's: one virtual [rows, K] weight, one load per tile.
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    is_down = offs_r < R
    is_inj = (offs_r >= R) & (offs_r < rows)
    if HAS_INJECT:
        w_rows = tl.where(is_down, wd_ptr + offs_r * K, wi_ptr + (offs_r - R) * K)
    else:
        w_rows = wd_ptr + offs_r * K
    k_start = stream * H + (pid_k % splits) * k_per_split
    k_end = stream * H + tl.minimum((pid_k % splits + 1) * k_per_split, H)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        xv = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        scale = 1.0 + tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        normed = round_to_dtype(xv * rstd[:, None] * scale[None, :], dtype)
        w = tl.load(w_rows[:, None] + offs_k[None, :], mask=(is_down | is_inj)[:, None] & mask_k[None, :], other=0.0)
        acc += tl.sum(normed[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)

    out_mask = mask_m[:, None] & (offs_r < rows)[None, :]
    part_offs = offs_m[:, None] * rows + offs_r[None, :]
    tl.store(part_ptr + pid_k * N * rows + part_offs, acc, mask=out_mask)
    # Every thread's partial must be written before one thread publishes the tile (acq_rel atomic).
    tl.debug_barrier()
    counter = count_ptr + pid_m * tl.num_programs(0) + pid_r
    n_k = tl.num_programs(1)
    if tl.atomic_add(counter, 1) == n_k - 1:
        total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for p in range(n_k):
            # .cg: read the other programs' partials from L2, never from a stale L1 line.
            total += tl.load(part_ptr + p * N * rows + part_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(counter, 0)
        v = round_to_dtype(round_to_dtype(total, dtype) / HC, dtype)
        mix = round_to_dtype(v * _sigmoid(v), dtype)
        tl.store(mix_ptr + offs_m[:, None] * R + offs_r[None, :], mix, mask=mask_m[:, None] & is_down[None, :])
        if HAS_INJECT:
            inj = 2.0 * round_to_dtype(_sigmoid(v), dtype)
            tl.store(inj_ptr + offs_m[:, None] * HC + (offs_r - R)[None, :], inj,
                     mask=mask_m[:, None] & is_inj[None, :])


@triton.jit
def _hc_up_kernel(x_ptr, nw_ptr, rms_ptr, mix_ptr, wu_ptr, out_ptr, N, H, R, stride_x, stride_o,
                  HC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KR: tl.constexpr):
    pid_h = tl.program_id(0)
    pid_m = tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < N
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    mask_mh = mask_m[:, None] & mask_h[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for s in tl.static_range(HC):
        acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
        for k0 in range(0, R, BLOCK_KR):
            offs_k = k0 + tl.arange(0, BLOCK_KR)
            mask_k = offs_k < R
            mv = tl.load(mix_ptr + offs_m[:, None] * R + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                         other=0.0).to(tl.float32)
            w = tl.load(wu_ptr + (s * H + offs_h)[:, None] * R + offs_k[None, :],
                        mask=mask_h[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(mv[:, None, :] * w[None, :, :], axis=2)
        gate = round_to_dtype(_sigmoid(round_to_dtype(acc, dtype)), dtype)
        xv = tl.load(x_ptr + offs_m[:, None] * stride_x + s * H + offs_h[None, :], mask=mask_mh, other=0.0)
        rstd = tl.load(rms_ptr + offs_m * HC + s, mask=mask_m, other=0.0)
        scale = 1.0 + tl.load(nw_ptr + s * H + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        normed = round_to_dtype(xv.to(tl.float32) * rstd[:, None] * scale[None, :], dtype)
        total += round_to_dtype(gate * normed, dtype)
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_h[None, :], total / HC, mask=mask_mh)


@triton.jit
def _hc_inject_kernel(h_ptr, bo_ptr, w_ptr, out_ptr, H, stride_h, stride_b, stride_w, stride_o,
                      HC: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.program_id(1)
    dtype = h_ptr.dtype.element_ty
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HC * H
    hv = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    bo = tl.load(bo_ptr + row * stride_b + offs % H, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + row * stride_w + offs // H, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, hv + round_to_dtype(bo * w, dtype), mask=mask)


@dataclass(frozen=True)
class MixConfig:
    block_m: int
    block_r: int      # down/inject rows per program
    block_k: int      # K tile of the down GEMV
    splits: int       # K splits per stream (the down grid is row tiles × hc·splits × row blocks)
    block_h: int      # block-input columns per up program
    block_kr: int     # K tile of the up GEMV (K = R)
    warps_down: int = 4
    warps_up: int = 4


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def default_config(n: int, hc: int, hidden: int, lowrank: int, rows: int, device: torch.device) -> MixConfig:
    """Register tiles of ~8K fp32 products per program; split K until the down grid has about two
    programs per SM (Flash-Next decode: 11 row tiles × 4 streams × 5 splits = 220; up: 320)."""
    block_m = min(triton.next_power_of_2(max(n, 1)), 8)
    block_r = 32
    block_k = min(max(32, 256 // block_m), triton.next_power_of_2(hidden))
    k_tiles = triton.cdiv(hidden, block_k)
    programs = triton.cdiv(rows, block_r) * hc * triton.cdiv(n, block_m)
    splits = max(1, min(k_tiles, round(2 * _num_sms(device) / programs)))
    block_h = 8
    block_kr = min(triton.next_power_of_2(lowrank), max(32, 4096 // (block_m * block_h)))
    return MixConfig(block_m, block_r, block_k, splits, block_h, block_kr)


def hc_mix_triton(h: torch.Tensor, norm_weight: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor,
                  w_inject: torch.Tensor | None, hc: int, hidden: int, eps: float,
                  config: MixConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [N, hc·H] → (block input [N, H], injection weights [N, hc] or None); see ops/hyper_connection.py."""
    n, width = h.shape
    lowrank = w_down.shape[0]
    assert width == hc * hidden and w_down.shape == (lowrank, width) and w_up.shape == (width, lowrank)
    assert w_inject is None or w_inject.shape == (hc, width)
    assert norm_weight.shape == (width,)
    assert all(t.is_contiguous() for t in (norm_weight, w_down, w_up) + ((w_inject,) if w_inject is not None else ()))
    if h.stride(-1) != 1:
        h = h.contiguous()
    block_input = h.new_empty(n, hidden)
    inject = h.new_empty(n, hc) if w_inject is not None else None
    if n == 0:
        return block_input, inject
    rows = lowrank + (hc if w_inject is not None else 0)
    cfg = config or default_config(n, hc, hidden, lowrank, rows, h.device)
    k_per_split = triton.cdiv(triton.cdiv(hidden, cfg.block_k), cfg.splits) * cfg.block_k
    splits = triton.cdiv(hidden, k_per_split)
    grid = (triton.cdiv(rows, cfg.block_r), hc * splits, triton.cdiv(n, cfg.block_m))
    work = torch.empty(hc * splits * n * rows + n * hc, dtype=torch.float32, device=h.device)
    partials, rms = work[:-n * hc], work[-n * hc:]
    mix = h.new_empty(n, lowrank)
    _hc_down_kernel[grid](
        h, norm_weight, w_down, w_inject if w_inject is not None else w_down, partials,
        arrival_counters(h.device, grid[0] * grid[2]), mix, inject if inject is not None else mix, rms,
        n, hidden, lowrank, h.stride(0), k_per_split, splits, eps,
        HC=hc, HAS_INJECT=w_inject is not None, BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k,
        BLOCK_RMS=max(64, 2048 // cfg.block_m), num_warps=cfg.warps_down)
    _hc_up_kernel[(triton.cdiv(hidden, cfg.block_h), triton.cdiv(n, cfg.block_m))](
        h, norm_weight, rms, mix, w_up, block_input, n, hidden, lowrank, h.stride(0), block_input.stride(0),
        HC=hc, BLOCK_M=cfg.block_m, BLOCK_H=cfg.block_h, BLOCK_KR=cfg.block_kr, num_warps=cfg.warps_up)
    return block_input, inject


def hc_inject_triton(h: torch.Tensor, block_output: torch.Tensor, weights: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """h [N, hc·H] + weights [N, hc] ⊗ block_output [N, H] → out (a new tensor, or `out`, which may be h)."""
    n, width = h.shape
    hc = weights.shape[-1]
    hidden = width // hc
    assert block_output.shape == (n, hidden) and weights.shape == (n, hc) and width == hc * hidden
    out = torch.empty_like(h) if out is None else out
    assert out.shape == h.shape and out.dtype == h.dtype and out.stride(-1) == 1
    tensors = [t if t.stride(-1) == 1 else t.contiguous() for t in (h, block_output, weights)]
    h, block_output, weights = tensors
    if n:
        block = 1024
        _hc_inject_kernel[(triton.cdiv(width, block), n)](
            h, block_output, weights, out, hidden, h.stride(0), block_output.stride(0), weights.stride(0),
            out.stride(0), HC=hc, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _hc_combine_kernel(up_ptr, normed_ptr, out_ptr, H, stride_up, stride_normed, stride_out,
                       HC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    dtype = up_ptr.dtype.element_ty
    total = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(HC):
        up = tl.load(up_ptr + row * stride_up + s * H + offs, mask=mask, other=0.0).to(tl.float32)
        normed = tl.load(normed_ptr + row * stride_normed + s * H + offs, mask=mask, other=0.0).to(tl.float32)
        total += round_to_dtype(round_to_dtype(_sigmoid(up), dtype) * normed, dtype)
    tl.store(out_ptr + row * stride_out + offs, (total / HC).to(out_ptr.dtype.element_ty), mask=mask)


def hc_combine_triton(up: torch.Tensor, normed: torch.Tensor, hc: int, hidden: int) -> torch.Tensor:
    """up [N, hc·H], normed [N, hc·H] → mean over streams of sigmoid(up) × normed [N, H] (ops/hyper_connection.py)."""
    n, width = up.shape
    assert normed.shape == up.shape and width == hc * hidden
    up = up if up.stride(-1) == 1 else up.contiguous()
    normed = normed if normed.stride(-1) == 1 else normed.contiguous()
    out = torch.empty(n, hidden, dtype=up.dtype, device=up.device)
    if n:
        block = 1024
        _hc_combine_kernel[(triton.cdiv(hidden, block), n)](up, normed, out, hidden, up.stride(0), normed.stride(0),
                                                           out.stride(0), HC=hc, BLOCK=block, num_warps=4)
    return out
