"""Triton GEMV for the small 16-bit projections of a decode step (y [M, N] = x [M, K] @ W.T, M <= 8, K <= 8192).

Flash-Next's router with the shared-expert gate ([513, 2560], 2.6 MB) and GatedDeltaNet's b|a ([96, 2560],
0.5 MB) took cuBLAS 4.3 and 5.5 µs per call on the H200, latency rather than bytes. Here a program owns
BLOCK_N rows of W and loads them whole (K padded to a power of two, masked) before it waits for x (ops/pdl.py),
then for each row of x multiplies and sums in fp32 and rounds once to x's dtype: the same result as F.linear up
to fp32 summation order. No K loop, no split, no reduction across programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.pdl import launch_options, wait_for_inputs

MAX_ROWS = 8
MAX_K = 8192
# Larger weights stay on cuBLAS, which streams big matrices at ~80% of the bandwidth (bf16 GDN qkv|z, 84 MB: 23 µs)
MAX_WEIGHT_BYTES = 8 << 20
ELEMENTS_PER_THREAD = 64   # the weight tile a thread holds: BLOCK_N × next_pow2(K) / (32 · warps)
NUM_WARPS = 4


@triton.jit
def _linear_gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    wait_for_inputs(PDL)
    for m in range(M):
        xv = tl.load(x_ptr + m * stride_x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
        tl.store(out_ptr + m * stride_o + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and weight.dim() == 2 and weight.shape[1] <= MAX_K
            and weight.numel() * weight.element_size() <= MAX_WEIGHT_BYTES and x.dtype == weight.dtype
            and weight.stride(-1) == 1)


def linear_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T → [M, N] in x's dtype (see supports())."""
    assert supports(x, weight), (tuple(x.shape), tuple(weight.shape), x.dtype, weight.dtype)
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(triton.next_power_of_2(n), ELEMENTS_PER_THREAD * 32 * NUM_WARPS // block_k))
    _linear_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=NUM_WARPS, **launch_options(x.device))
    return out
