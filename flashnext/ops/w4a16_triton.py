"""Triton W4A16 matmul: y [M, N] = x [M, K] @ W.T with W held in the INT4 kernel layout (docs/int4.md).

One kernel, two reductions chosen at compile time:
- decode GEMV (M ≤ 4): x·(q − z) as fp32 multiply-and-sum in registers (no tensor cores: at M ≤ 4 they
  would idle 3/4 of every MMA and cost a shared-memory round trip);
- GEMM (M > 4): `tl.dot` of x with the (q − z) tile in x's dtype — exact, those are integers in [−16, 15] —
  accumulated in fp32.
Both multiply each K tile's fp32 partial by its group's scale (BLOCK_K divides the group size), so the
result differs from dequantise-then-matmul only by fp32 summation order.
The grid is (N blocks, K splits, M blocks); with more than one K split the partials are added with fp32
atomics into a zeroed buffer (decode shapes are too narrow to fill the GPU otherwise: N = 2560 in blocks of
64 is 40 programs for 132 SMs).
`qweight` is read along N, which is contiguous: 4 int32 (16 bytes) per thread and load.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.weights.int4_layout import Int4Weight


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr,
                  M, N, K, stride_xm, stride_om, k_per_split,
                  GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
                  USE_DOT: tl.constexpr, ATOMIC: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_packed = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        packed = tl.load(qw_ptr + (k0 // 8 + offs_packed)[:, None] * N + offs_n[None, :],
                         mask=mask_n[None, :], other=0)                          # [BK/8, BN] int32
        # Arithmetic shift of the top nibble sign-extends; the mask drops it.
        q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        group = k0 // GROUP
        if HAS_ZEROS:
            zero = tl.load(z_ptr + group * N + offs_n, mask=mask_n, other=0).to(tl.int32)
            q = q - zero[None, :]
        else:
            q = q - 8
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if HAS_PERM:
            cols = tl.load(perm_ptr + offs_k)
        else:
            cols = offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask_m[:, None], other=0.0)
        if USE_DOT:
            part = tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION)
        else:
            part = tl.sum(x.to(tl.float32)[:, :, None] * q.to(tl.float32)[None, :, :], axis=1)
        scale = tl.load(s_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += part * scale[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16


GEMV_MAX_M = 4


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def default_config(m: int, n: int, k: int, group_size: int, device: torch.device) -> LaunchConfig:
    """Launch shapes by problem size: GEMV for decode, dot tiles otherwise; split K until the grid has
    about two programs per SM."""
    if m <= GEMV_MAX_M:
        block_m = triton.next_power_of_2(m)
        block_n, block_k, warps, stages = 64, min(group_size, 128 // block_m), 4, 4
    elif m <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, min(group_size, 128), 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 64, 128, min(group_size, 64), 4, 3
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, min(group_size, 64), 8, 3
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = max(1, min(triton.cdiv(2 * _num_sms(device), programs), k // block_k))
    return LaunchConfig(block_m, block_n, block_k, split, warps, stages)


def supports(w: Int4Weight) -> bool:
    """The kernel needs K tiles of ≥ 16 rows that never straddle a group."""
    return w.group_size >= 16 and w.group_size & (w.group_size - 1) == 0 and w.qweight.dim() == 2


def w4a16_matmul(x: torch.Tensor, w: Int4Weight, config: LaunchConfig | None = None) -> torch.Tensor:
    """x [M, K] (row-major) → [M, N] in x's dtype."""
    m, k = x.shape
    n = w.out_features
    assert k == w.in_features and supports(w), (tuple(x.shape), tuple(w.qweight.shape), w.group_size)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m == 0:
        return x.new_empty(0, n)
    cfg = config or default_config(m, n, k, w.group_size, x.device)
    assert w.group_size % cfg.block_k == 0, "a K tile must not straddle two groups"
    steps = k // cfg.block_k
    k_per_split = triton.cdiv(steps, cfg.split_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    atomic = split > 1
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic else torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    dummy = w.qweight
    _w4a16_kernel[grid](
        x, w.qweight, w.scales, w.zeros if w.zeros is not None else dummy, w.perm if w.perm is not None else dummy, out,
        m, n, k, x.stride(0), out.stride(0), k_per_split,
        GROUP=w.group_size, HAS_ZEROS=w.zeros is not None, HAS_PERM=w.perm is not None,
        USE_DOT=cfg.use_dot, ATOMIC=atomic, DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.to(x.dtype) if atomic else out
