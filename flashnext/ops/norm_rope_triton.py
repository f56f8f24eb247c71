"""Norm + partial RoPE in one kernel, one program per (row, head) (reference: ops/norm_rope.py).

The rotation pairs feature i < R/2 with i + R/2: each program loads the head twice (as is and at the partner
features) instead of moving values between lanes. 16-bit results are rounded where torch rounds: after the
norm, after each product with cos / sin, after their sum."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.ops.rounding import round_to_dtype


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, stride_xn, stride_xh, stride_cn, heads, D, R, eps,
                      BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0) // heads
    head = tl.program_id(0) % heads
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    half = R // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    rotating = offs < R
    base = x_ptr + row * stride_xn + head * stride_xh
    x = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = round_to_dtype(x * rstd * (1.0 + tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)), dtype)
    xp = tl.load(base + partner, mask=rotating, other=0.0).to(tl.float32)
    yp = round_to_dtype(xp * rstd * (1.0 + tl.load(w_ptr + partner, mask=rotating, other=0.0).to(tl.float32)), dtype)
    cos = tl.load(cos_ptr + row * stride_cn + offs, mask=rotating, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_cn + offs, mask=rotating, other=0.0).to(tl.float32)
    rotated = tl.where(offs < half, -yp, yp)
    out = tl.where(rotating, round_to_dtype(y * cos, dtype) + round_to_dtype(rotated * sin, dtype), y)
    tl.store(out_ptr + (row * heads + head) * D + offs, out.to(dtype), mask=ok)


def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    rows, heads, dim = x.shape
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    out = torch.empty(rows, heads, dim, dtype=x.dtype, device=x.device)
    if rows:
        _norm_rope_kernel[(rows * heads,)](x, weight, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), heads,
                                           dim, cos.shape[-1], eps, BLOCK_D=triton.next_power_of_2(dim), num_warps=2,
                                           **launch_options(x.device))
    return out
