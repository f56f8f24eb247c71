"""Zero-centred RMSNorm in one kernel, one program per (row, group), and GatedDeltaNet's gated RMSNorm, one
program per row (references: ops/rms_norm.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.ops.rounding import round_to_dtype


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_row, groups, group_size, eps, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0) // groups
    group = tl.program_id(0) % groups
    offs = tl.arange(0, BLOCK)
    ok = offs < group_size
    col = group * group_size + offs
    x = tl.load(x_ptr + row * stride_row + col, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / group_size + eps)
    w = tl.load(w_ptr + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * groups * group_size + col, (x * rstd * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    dim = x.shape[-1]
    group_size = group_size or dim
    rows = x.reshape(-1, dim)              # a view when the leading dims allow, with any row stride
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    groups = dim // group_size
    if rows.shape[0]:
        block = triton.next_power_of_2(group_size)
        _rms_norm_kernel[(rows.shape[0] * groups,)](rows, weight, out, rows.stride(0), groups, group_size, eps,
                                                     BLOCK=block, num_warps=8 if block >= 4096 else 4,
                                                     **launch_options(rows.device))
    return out


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, stride_x, stride_g, dim, eps, SILU: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < dim
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    normed = round_to_dtype(x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps), dtype)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    h = round_to_dtype(w * normed, dtype)          # the reference rounds weight · normed to the dtype
    g = tl.load(g_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    act = g * tl.sigmoid(g) if SILU else tl.sigmoid(g)
    tl.store(out_ptr + row * dim + offs, (h * act).to(dtype), mask=ok)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          activation: str) -> torch.Tensor:
    dim = x.shape[-1]
    rows, gates = x.reshape(-1, dim), gate.reshape(-1, dim)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    gates = gates if gates.stride(-1) == 1 else gates.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _gated_rms_norm_kernel[(rows.shape[0],)](rows, gates, weight, out, rows.stride(0), gates.stride(0), dim, eps,
                                                 SILU=activation == "silu", BLOCK=triton.next_power_of_2(dim),
                                                 num_warps=4, **launch_options(rows.device))
    return out
