"""Triton hyper-connection mix (two launches) and inject (one), for decode (below rows_kernel_min() rows of
ops/hyper_connection.py, where the tensor-core mix takes over; any N is correct).

The mix reads two [R, hc·H] weights (2 × 6.5 MB at Flash-Next's shapes) and little else: it is a chain of
latency (launch, first DRAM loads, a reduction) unless every launch loads its whole share of a weight at once,
before it waits for its input (ops/pdl.py). So neither kernel has a loop over K or a dependent load chain:
- `_hc_down_kernel`, grid (tiles of BLOCK_R rows of w_down then w_inject, hc streams): a program loads its rows'
  [BLOCK_R, H] slice of one stream (and that slice of the norm weight) — everything it will read from DRAM —,
  waits for h, then for each row of h stores the partial dot of its rows with the stream scaled by (1 + norm
  weight), and the stream's sum of squares. The stream's rstd is a scalar of the dot, so it is applied later:
  no second pass over h and no reduction across programs inside the launch. The one departure from the
  reference: the normed stream is not rounded to h's dtype before the down GEMV (it is in fp32 math).
- `_hc_up_kernel`, grid (column tiles of H): a program loads its columns' up-weight rows of every stream
  ([hc, BLOCK_H, R]), waits, then adds the hc stream partials of the down rows (times each stream's rstd, one
  fixed reduction: deterministic), applies /hc and silu (and 2·sigmoid for the injection rows, stored by program 0),
  and for each stream the up GEMV, sigmoid, times the normed stream, summed over the streams.
Both GEMVs are fp32 multiply-and-sum in registers (no tensor cores: a row or a few). Elsewhere values are rounded to
h's dtype wherever the reference rounds.
`hc_mix_injected_triton`: the mix of the streams after the previous block's injection, without the inject launch
(decode: every mix but the first follows an injection): the down kernel adds weight × block output to the stream it
reads, as `_hc_inject_kernel` rounds it, and its first row tile writes the new h for the up kernel and the next
injection.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.ops.rounding import round_to_dtype


@triton.jit
def sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def down_inject_rows(wd_ptr, wi_ptr, R, H, HC: tl.constexpr, HAS_INJECT: tl.constexpr, BLOCK_R: tl.constexpr):
    """A down program's (grid axis 0) tile of BLOCK_R rows of one virtual [R (+ hc), hc·H] weight — rows [0, R) are
    w_down's, [R, R + hc) w_inject's: the down kernel computes both GEMVs in one pass over the streams —
    → (the rows there are, the tile's row ids, which of them exist, their pointers)."""
    rows = R + HC if HAS_INJECT else R
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if HAS_INJECT:
        w_rows = tl.where(offs_r < R, wd_ptr + offs_r * HC * H, wi_ptr + (offs_r - R) * HC * H)
    else:
        w_rows = wd_ptr + offs_r * HC * H
    return rows, offs_r, offs_r < rows, w_rows


@triton.jit
def _hc_down_kernel(x_ptr, nw_ptr, wd_ptr, wi_ptr, part_ptr, sumsq_ptr, bo_ptr, pw_ptr, hout_ptr, N, H, R, stride_x,
                    stride_bo, stride_pw, stride_hout, HC: tl.constexpr, HAS_INJECT: tl.constexpr,
                    HAS_PENDING: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pid_r, stream = tl.program_id(0), tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    rows, offs_r, r_ok, w_rows = down_inject_rows(wd_ptr, wi_ptr, R, H, HC, HAS_INJECT, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    w = tl.load(w_rows[:, None] + stream * H + offs_h[None, :], mask=r_ok[:, None] & h_ok[None, :], other=0.0)
    scale = 1.0 + tl.load(nw_ptr + stream * H + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    for m in range(N):
        xv = tl.load(x_ptr + m * stride_x + stream * H + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        if HAS_PENDING:   # the previous block's injection first: h + weight × block output, as hc_inject rounds it
            bo = tl.load(bo_ptr + m * stride_bo + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            weight = tl.load(pw_ptr + m * stride_pw + stream).to(tl.float32)
            injected = (xv + round_to_dtype(bo * weight, dtype)).to(dtype)
            if pid_r == 0:
                tl.store(hout_ptr + m * stride_hout + stream * H + offs_h, injected, mask=h_ok)
            xv = injected.to(tl.float32)
        if pid_r == 0:
            tl.store(sumsq_ptr + m * HC + stream, tl.sum(xv * xv))
        part = tl.sum(w.to(tl.float32) * (xv * scale)[None, :], axis=1)
        tl.store(part_ptr + (stream * N + m) * rows + offs_r, part, mask=r_ok)


@triton.jit
def _down_rows(part_ptr, rstd, offs_s, s_ok, N, m, rows, offs_k, k_ok, HC: tl.constexpr, dtype: tl.constexpr):
    """Rows offs_k of the down/inject GEMV for row m: the stream partials times their rstd, summed (the same
    reduction every launch); then rounded to the dtype and divided by hc as the reference does."""
    parts = tl.load(part_ptr + (offs_s[:, None] * N + m) * rows + offs_k[None, :],
                    mask=s_ok[:, None] & k_ok[None, :], other=0.0)
    total = tl.sum(parts * rstd[:, None], axis=0)
    return round_to_dtype(round_to_dtype(total, dtype) / HC, dtype)


@triton.jit
def _hc_up_kernel(x_ptr, nw_ptr, part_ptr, sumsq_ptr, wu_ptr, out_ptr, inj_ptr, N, H, R, stride_x, stride_o, eps,
                  HC: tl.constexpr, HAS_INJECT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_KR: tl.constexpr, PDL: tl.constexpr):
    pid_h = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    rows = R + HC if HAS_INJECT else R
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < HC
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_k = tl.arange(0, BLOCK_KR)
    k_ok = offs_k < R
    sh = offs_s[:, None] * H + offs_h[None, :]                                       # [S, BLOCK_H]
    sh_ok = s_ok[:, None] & h_ok[None, :]
    w = tl.load(wu_ptr + sh[:, :, None] * R + offs_k[None, None, :], mask=sh_ok[:, :, None] & k_ok[None, None, :],
                other=0.0)                                                           # [S, BLOCK_H, BLOCK_KR]
    scale = 1.0 + tl.load(nw_ptr + sh, mask=sh_ok, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    for m in range(N):
        sumsq = tl.load(sumsq_ptr + m * HC + offs_s, mask=s_ok, other=0.0)
        rstd = tl.where(s_ok, tl.math.rsqrt(sumsq / H + eps), 0.0)
        v = _down_rows(part_ptr, rstd, offs_s, s_ok, N, m, rows, offs_k, k_ok, HC, dtype)
        mix = round_to_dtype(v * sigmoid(v), dtype)
        up = round_to_dtype(tl.sum(w.to(tl.float32) * mix[None, None, :], axis=2), dtype)
        gate = round_to_dtype(sigmoid(up), dtype)
        xv = tl.load(x_ptr + m * stride_x + sh, mask=sh_ok, other=0.0).to(tl.float32)
        normed = round_to_dtype(xv * rstd[:, None] * scale, dtype)
        total = tl.sum(tl.where(sh_ok, round_to_dtype(gate * normed, dtype), 0.0), axis=0)
        tl.store(out_ptr + m * stride_o + offs_h, total / HC, mask=h_ok)
        if HAS_INJECT:
            if pid_h == 0:
                v_inj = _down_rows(part_ptr, rstd, offs_s, s_ok, N, m, rows, R + offs_s, s_ok, HC, dtype)
                tl.store(inj_ptr + m * HC + offs_s, 2.0 * round_to_dtype(sigmoid(v_inj), dtype), mask=s_ok)


@triton.jit
def _hc_inject_kernel(h_ptr, bo_ptr, w_ptr, out_ptr, H, stride_h, stride_b, stride_w, stride_o,
                      HC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.program_id(1)
    dtype = h_ptr.dtype.element_ty
    wait_for_inputs(PDL)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HC * H
    hv = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    bo = tl.load(bo_ptr + row * stride_b + offs % H, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + row * stride_w + offs // H, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, hv + round_to_dtype(bo * w, dtype), mask=mask)


@dataclass(frozen=True)
class MixConfig:
    block_r: int = 8      # down/inject rows per program (the down grid is row tiles × hc streams)
    block_h: int = 4      # block-input columns per up program
    warps_down: int = 4
    warps_up: int = 4


# Flash-Next decode (hidden 2560 → 4096 lanes, R 320): 41 × 4 down programs of 40 KB, 640 up programs of 10 KB,
# their weights in registers. H200 sweep (scripts/gpu_hyper_connection.py --sweep, one row, L2-warm): 6.6 µs per
# mix with 8 down rows, 6.9 with 2; 1–8 rows, 1–8 columns and 2–8 warps all within 10% of it. Tiling the padded
# widths as a power-of-two head and tail instead (2560 = 2048 + 512, 320 = 256 + 64; 140ed6f) made the eager up
# kernel faster (6.5 → 5.6 µs) and the down kernel slower (4.6 → 4.9), and the captured step slower (4.75–4.79 ms
# against 4.63): reverted.
DEFAULT_CONFIG = MixConfig()


def hc_mix_triton(h: torch.Tensor, norm_weight: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor,
                  w_inject: torch.Tensor | None, hc: int, hidden: int, eps: float,
                  config: MixConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [N, hc·H] → (block input [N, H], injection weights [N, hc] or None); see ops/hyper_connection.py."""
    block_input, inject, _ = _mix(h, None, norm_weight, w_down, w_up, w_inject, hc, hidden, eps, config)
    return block_input, inject


def hc_mix_injected_triton(h: torch.Tensor, block_output: torch.Tensor, weights: torch.Tensor,
                           norm_weight: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor,
                           w_inject: torch.Tensor | None, hc: int, hidden: int, eps: float,
                           config: MixConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The mix of h + weights ⊗ block_output (the previous block's injection), which the down kernel computes on
    its way in — no inject launch — and writes out: → (block input, injection weights or None, the new h)."""
    return _mix(h, (block_output, weights), norm_weight, w_down, w_up, w_inject, hc, hidden, eps, config)


def mix_outputs(h, pending, norm_weight, w_down, w_up, w_inject, hc, hidden):
    """What both mixes (these kernels and ops/hyper_connection_rows_triton.py) check and allocate alike: → (h with a
    unit last stride, the pending injection's block output and weights with one (else h standing in, never read),
    block input [N, H], injection weights [N, hc] or None, the streams the up kernel reads (a new tensor the down
    kernel writes after a pending injection, else h), the rows of down|inject)."""
    n, width = h.shape
    lowrank = w_down.shape[0]
    assert width == hc * hidden and w_down.shape == (lowrank, width) and w_up.shape == (width, lowrank)
    assert w_inject is None or w_inject.shape == (hc, width)
    assert norm_weight.shape == (width,)
    assert all(t.is_contiguous() for t in (norm_weight, w_down, w_up) + ((w_inject,) if w_inject is not None else ()))
    if h.stride(-1) != 1:
        h = h.contiguous()
    if pending is not None:
        block_output, weights = (t if t.stride(-1) == 1 else t.contiguous() for t in pending)
        assert block_output.shape == (n, hidden) and weights.shape == (n, hc)
    else:
        block_output, weights = h, h
    block_input = h.new_empty(n, hidden)
    inject = h.new_empty(n, hc) if w_inject is not None else None
    injected = torch.empty_like(h) if pending is not None else h
    return h, block_output, weights, block_input, inject, injected, lowrank + (hc if w_inject is not None else 0)


def _mix(h, pending, norm_weight, w_down, w_up, w_inject, hc, hidden, eps, config):
    n, lowrank = h.shape[0], w_down.shape[0]
    h, block_output, weights, block_input, inject, injected, rows = mix_outputs(h, pending, norm_weight, w_down, w_up,
                                                                                w_inject, hc, hidden)
    if n == 0:
        return block_input, inject, injected
    # the down kernel's fp32 partials for hc streams × N rows of h, and the streams' sums of squares
    work = torch.empty(hc * n * rows + n * hc, dtype=torch.float32, device=h.device)
    partials, sumsq = work[:hc * n * rows], work[hc * n * rows:]
    pdl = launch_options(h.device)
    _hc_down_kernel[(triton.cdiv(rows, config.block_r), hc)](
        h, norm_weight, w_down, w_inject if w_inject is not None else w_down, partials, sumsq,
        block_output, weights, injected, n, hidden, lowrank, h.stride(0), block_output.stride(0), weights.stride(0),
        injected.stride(0), HC=hc, HAS_INJECT=w_inject is not None, HAS_PENDING=pending is not None,
        BLOCK_R=config.block_r, BLOCK_H=triton.next_power_of_2(hidden), num_warps=config.warps_down, **pdl)
    _hc_up_kernel[(triton.cdiv(hidden, config.block_h),)](
        injected, norm_weight, partials, sumsq, w_up, block_input, inject if inject is not None else block_input,
        n, hidden, lowrank, injected.stride(0), block_input.stride(0), eps, HC=hc, HAS_INJECT=w_inject is not None,
        BLOCK_S=triton.next_power_of_2(hc), BLOCK_H=config.block_h, BLOCK_KR=triton.next_power_of_2(lowrank),
        num_warps=config.warps_up, **pdl)
    return block_input, inject, injected


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
            out.stride(0), HC=hc, BLOCK=block, num_warps=4, **launch_options(h.device))
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
        total += round_to_dtype(round_to_dtype(sigmoid(up), dtype) * normed, dtype)
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
