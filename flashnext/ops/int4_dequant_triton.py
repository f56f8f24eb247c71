"""INT4 kernel layout → a 16-bit [K, N] weight in one pass, for prefill-sized W4A16 matmuls through cuBLAS.

At prefill sizes (thousands of rows) a W4A16 GEMM is compute-bound, and the Triton GEMM kernel ran at ~0.38×
bf16 cuBLAS on the H200 (BENCHMARKS.md). Dequantising the one weight a call needs into a scratch tensor
costs reading its 0.5 byte and writing its 2 bytes per weight — for Flash-Next's in_proj_qkv (10240 × 2560) 21
µs against ~590 µs of cuBLAS at 8,192 rows — so `w4a16_matmul` sends M >= 256 here (2.3–2.8× the GEMM kernel on
the H200 from 512 rows; `FLASHNEXT_W4A16_PREFILL=triton` turns it off; vLLM's AWQ path does the same above 256
tokens). Only one weight's scratch exists at a time; the
model keeps INT4. Stacked experts [E, K/8, N] dequantise in one launch (a grid axis per expert) for the MoE
prefill path of ops/moe_int4_dequant.py.

The reference is `weights.int4_layout.dequantize` (fp32 [N, K] in activation order): this returns its
transpose in the requested dtype, rows in activation order (act-order scatters packed row k to row perm[k]).
Each weight is scale · (q − zero) rounded once to the dtype: the rounding the bf16 matmul adds over the
reference (which keeps the product in fp32) is that one rounding per weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.int4_groups import group_zero_scale, optional_tensors
from flashnext.weights.int4_layout import Int4Weight


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, N, K, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    HAS_PERM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.program_id(2).to(tl.int64)   # stacked experts: one [K, N] after the other, contiguous
    qw_ptr += expert * (K // 8) * N
    s_ptr += expert * (K // GROUP) * N
    out_ptr += expert * K * N
    if HAS_ZEROS:
        z_ptr += expert * (K // GROUP) * N
    if HAS_PERM:
        perm_ptr += expert * K
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)          # packed rows: K/8 of them
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    p_ok = offs_p < K // 8
    n_ok = offs_n < N
    ok = p_ok[:, None] & n_ok[None, :]
    packed = tl.load(qw_ptr + offs_p[:, None] * N + offs_n[None, :], mask=ok, other=0)
    group = offs_p * 8 // GROUP                                 # the 8 rows of a word share it (8 divides GROUP)
    zero, scale = group_zero_scale(z_ptr, s_ptr, group[:, None], N, offs_n[None, :], ok, HAS_ZEROS, BLOCK_N)
    for j in tl.static_range(8):
        k = offs_p * 8 + j                                      # packed row order
        q = (packed >> (4 * j)) & 0xF
        w = scale * (q.to(tl.float32) - zero)
        if HAS_PERM:
            row = tl.load(perm_ptr + k, mask=p_ok, other=0)
        else:
            row = k
        tl.store(out_ptr + row[:, None].to(tl.int64) * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_triton(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """→ [K, N] in `dtype`: dequantize(w).t() rounded once; stacked experts [E, K/8, N] → [E, K, N]."""
    assert w.qweight.dim() in (2, 3) and all(t.is_contiguous() for t in w.tensors().values())
    experts = w.qweight.shape[0] if w.qweight.dim() == 3 else 1
    k, n = w.in_features, w.out_features
    out = torch.empty(*w.qweight.shape[:-2], k, n, dtype=dtype, device=w.qweight.device)
    block_p, block_n = 8, 128
    grid = (triton.cdiv(k // 8, block_p), triton.cdiv(n, block_n), experts)
    zeros, perm = optional_tensors(w)
    _dequant_kernel[grid](w.qweight, w.scales, zeros, perm, out, n, k, GROUP=w.group_size,
                          HAS_ZEROS=w.zeros is not None, HAS_PERM=w.perm is not None, BLOCK_P=block_p,
                          BLOCK_N=block_n, num_warps=4)
    return out
