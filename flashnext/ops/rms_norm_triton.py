"""Zero-centred RMSNorm in one kernel, per row or per group of a row, and GatedDeltaNet's gated RMSNorm
(references: ops/rms_norm.py). A program normalises ROWS rows (or groups) at once: prefill has hundreds of
thousands of short ones (Flash-Next's GatedDeltaNet: 8,192 tokens × 32 heads of 128), and one program each
left the GPU waiting on program launches (0.29 ms per 8,192-token layer on the H200, ~6× its bytes' time)."""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from flashnext.ops.device import num_sms
from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.ops.rounding import round_to_dtype

PROGRAMS_PER_SM = 2       # rows are grouped only while every SM keeps this many programs
MAX_TILE = 4096           # elements a program holds (ROWS × BLOCK): 32 fp32 registers a thread at 4 warps


def rows_per_program(rows: int, block: int, device: torch.device) -> int:
    """A power of two: 1 for decode's few rows (one program each, all SMs busy), up to MAX_TILE // block."""
    per = max(1, rows // (PROGRAMS_PER_SM * num_sms(device)))
    return max(1, min(triton.next_power_of_2(per + 1) // 2, MAX_TILE // block))


@triton.jit(do_not_specialize=["n_units"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_units, stride_row, groups, group_size, eps, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    unit = tl.program_id(0) * ROWS + tl.arange(0, ROWS)          # (row, group) pairs, row-major
    row, group = unit // groups, unit % groups
    offs = tl.arange(0, BLOCK)
    ok = (unit < n_units)[:, None] & (offs < group_size)[None, :]
    col = group[:, None] * group_size + offs[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_row + col, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / group_size + eps)
    w = tl.load(w_ptr + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row[:, None] * groups * group_size + col,
             (x * rstd[:, None] * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None,
                    rows_per_prog: int | None = None) -> torch.Tensor:
    """`rows_per_prog` forces ROWS (tests); by default rows_per_program's choice."""
    dim = x.shape[-1]
    group_size = group_size or dim
    rows = x.reshape(-1, dim)              # a view when the leading dims allow, with any row stride
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    groups = dim // group_size
    units = rows.shape[0] * groups
    if units:
        block = triton.next_power_of_2(group_size)
        per = rows_per_prog or rows_per_program(units, block, x.device)
        _rms_norm_kernel[(triton.cdiv(units, per),)](rows, weight, out, units, rows.stride(0), groups, group_size, eps,
                                                      ROWS=per, BLOCK=block, num_warps=8 if per * block >= 4096 else 4,
                                                      **launch_options(rows.device))
    return out


@triton.jit(do_not_specialize=["n_rows"])
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, n_rows, stride_x, stride_g, dim, eps, SILU: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    ok = (row < n_rows)[:, None] & (offs < dim)[None, :]
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row[:, None] * stride_x + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    normed = round_to_dtype(x * tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)[:, None], dtype)
    w = tl.load(w_ptr + offs, mask=offs < dim, other=0.0).to(tl.float32)
    h = round_to_dtype(w[None, :] * normed, dtype)          # the reference rounds weight · normed to the dtype
    g = tl.load(g_ptr + row[:, None] * stride_g + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    act = g * tl.sigmoid(g) if SILU else tl.sigmoid(g)
    tl.store(out_ptr + row[:, None] * dim + offs[None, :], (h * act).to(dtype), mask=ok)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          activation: str, rows_per_prog: int | None = None) -> torch.Tensor:
    dim = x.shape[-1]
    rows, gates = x.reshape(-1, dim), gate.reshape(-1, dim)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    gates = gates if gates.stride(-1) == 1 else gates.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = rows.shape[0]
    if n:
        block = triton.next_power_of_2(dim)
        per = rows_per_prog or rows_per_program(n, block, x.device)
        _gated_rms_norm_kernel[(triton.cdiv(n, per),)](rows, gates, weight, out, n, rows.stride(0), gates.stride(0),
                                                       dim, eps, SILU=activation == "silu", ROWS=per, BLOCK=block,
                                                       num_warps=8 if per * block >= 4096 else 4,
                                                       **launch_options(rows.device))
    return out
