"""silu·mul and the shared-expert gated add, one program per (row, column block), and gated attention's output
gate, one program per (row, head) (references: ops/gated_elementwise.py); 16-bit results rounded after each step
as torch rounds them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.ops.rounding import round_to_dtype

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    dtype = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    act = round_to_dtype(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + row * N + offs, (act * u).to(dtype), mask=ok)


@triton.jit
def _gated_add_kernel(r_ptr, s_ptr, l_ptr, out_ptr, stride_r, stride_s, stride_l, N, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    dtype = out_ptr.dtype.element_ty
    gate = round_to_dtype(tl.sigmoid(tl.load(l_ptr + row * stride_l).to(tl.float32)), dtype)
    shared = tl.load(s_ptr + row * stride_s + offs, mask=ok, other=0.0).to(tl.float32)
    routed = tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (routed + round_to_dtype(gate * shared, dtype)).to(dtype), mask=ok)


@triton.jit
def _sigmoid_gate_kernel(o_ptr, g_ptr, out_ptr, stride_on, stride_oh, stride_gn, stride_gh, heads, D,
                         BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    dtype = out_ptr.dtype.element_ty
    o = tl.load(o_ptr + row * stride_on + head * stride_oh + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_gn + head * stride_gh + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (row * heads + head) * D + offs, (o * round_to_dtype(tl.sigmoid(g), dtype)).to(dtype), mask=ok)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    rows, n = gate.shape
    assert gate.stride(-1) == 1 and up.stride(-1) == 1 and up.shape == gate.shape
    out = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, BLOCK))](gate, up, out, gate.stride(0), up.stride(0), n, BLOCK=BLOCK,
                                                         **launch_options(gate.device))
    return out


def gated_add_triton(routed: torch.Tensor, shared: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    rows, n = routed.shape
    assert routed.stride(-1) == 1 and shared.stride(-1) == 1 and logit.shape == (rows, 1)
    out = torch.empty(rows, n, dtype=routed.dtype, device=routed.device)
    if rows:
        _gated_add_kernel[(rows, triton.cdiv(n, BLOCK))](routed, shared, logit, out, routed.stride(0), shared.stride(0),
                                                         logit.stride(0), n, BLOCK=BLOCK,
                                                         **launch_options(routed.device))
    return out


def sigmoid_gate_triton(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    rows, heads, d = out.shape
    assert gate.shape == out.shape and out.stride(-1) == 1 and gate.stride(-1) == 1
    result = torch.empty(rows, heads * d, dtype=out.dtype, device=out.device)
    if rows:
        _sigmoid_gate_kernel[(rows, heads)](out, gate, result, out.stride(0), out.stride(1), gate.stride(0),
                                            gate.stride(1), heads, d, BLOCK_D=triton.next_power_of_2(d),
                                            **launch_options(out.device))
    return result
