"""QSA block scores in one kernel: programs over (row, tile of block slots), each key read once through the block
table, the index heads summed in registers (reference: ops/qsa_scores.py)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flashnext.ops.pdl import launch_options, wait_for_inputs

BLOCK_N = 64


@triton.jit
def _qsa_scores_kernel(q_ptr, keys_ptr, table_ptr, before_ptr, out_ptr, stride_qb, stride_qh, stride_table,
                       capacity, D, scale, HEADS: tl.constexpr, PER_PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = n < capacity
    d_ok = offs_d < D
    page = tl.load(table_ptr + b * stride_table + n // PER_PAGE, mask=n_ok, other=0).to(tl.int64)
    rows = page * PER_PAGE + n % PER_PAGE
    keys = tl.load(keys_ptr + rows[:, None] * D + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                   other=0.0).to(tl.float32)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h in tl.static_range(HEADS):
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        total += tl.maximum(tl.sum(keys * q[None, :], axis=1), 0.0)
    before = tl.load(before_ptr + b)
    scores = tl.where(n < before, total * scale, float("-inf"))
    tl.store(out_ptr + b * capacity + n, scores, mask=n_ok)


def qsa_block_scores_triton(q: torch.Tensor, index_keys: torch.Tensor, block_table: torch.Tensor,
                            complete_before: torch.Tensor) -> torch.Tensor:
    batch, heads, dim = q.shape
    per_page = index_keys.shape[1]
    capacity = block_table.shape[1] * per_page
    assert q.stride(-1) == 1 and index_keys.is_contiguous() and block_table.stride(-1) == 1
    out = torch.empty(batch, capacity, dtype=torch.float32, device=q.device)
    if batch:
        _qsa_scores_kernel[(batch, triton.cdiv(capacity, BLOCK_N))](
            q, index_keys, block_table, complete_before, out, q.stride(0), q.stride(1), block_table.stride(0),
            capacity, dim, 1.0 / math.sqrt(dim), HEADS=heads, PER_PAGE=per_page, BLOCK_N=BLOCK_N,
            BLOCK_D=triton.next_power_of_2(dim), num_warps=4, **launch_options(q.device))
    return out


@triton.jit(do_not_specialize=["T", "NBLK"])
def _qsa_prefill_scores_kernel(q_ptr, keys_ptr, before_ptr, out_ptr, T, NBLK, stride_qt, stride_qh, stride_o, scale,
                               HEADS: tl.constexpr, D: tl.constexpr, FP32: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_d = tl.arange(0, D)
    t_ok = offs_t < T
    b_ok = offs_b < NBLK
    keys = tl.load(keys_ptr + offs_b[:, None] * D + offs_d[None, :], mask=b_ok[:, None], other=0.0)
    total = tl.zeros([BLOCK_T, BLOCK_B], dtype=tl.float32)
    for h in tl.static_range(HEADS):
        q = tl.load(q_ptr + offs_t[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=t_ok[:, None],
                    other=0.0)
        if FP32:
            s = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(keys))
        total += tl.maximum(s, 0.0)
    before = tl.load(before_ptr + offs_t, mask=t_ok, other=0)
    scores = tl.where(offs_b[None, :] < before[:, None], total * scale, float("-inf"))
    tl.store(out_ptr + offs_t[:, None] * stride_o + offs_b[None, :], scores, mask=t_ok[:, None] & b_ok[None, :])


def qsa_prefill_scores_triton(q: torch.Tensor, keys: torch.Tensor, complete_before: torch.Tensor) -> torch.Tensor:
    """See ops/qsa_scores.py qsa_prefill_scores_reference; q and keys in one dtype (bf16 on tensor cores, fp32 as
    IEEE dots)."""
    length, heads, dim = q.shape
    nblk = keys.shape[0]
    assert dim == triton.next_power_of_2(dim) and dim >= 16 and q.stride(-1) == 1, q.shape
    keys = keys.to(q.dtype).contiguous()
    # rows padded to a multiple of 16 blocks: the row stride, which this kernel and the token lists' read the scores
    # by, is then of one divisibility class whatever the context (Triton compiles per class: docs/architecture.md)
    width = triton.cdiv(nblk, 16) * 16
    out = torch.empty(length, width, dtype=torch.float32, device=q.device)[:, :nblk]
    if length and nblk:
        block_t, block_b = (64, 64) if q.is_cuda else (16, 16)
        _qsa_prefill_scores_kernel[(triton.cdiv(length, block_t), triton.cdiv(nblk, block_b))](
            q, keys, complete_before, out, length, nblk, q.stride(0), q.stride(1), out.stride(0), 1.0 / math.sqrt(dim),
            HEADS=heads, D=dim, FP32=q.dtype == torch.float32, BLOCK_T=block_t, BLOCK_B=block_b, num_warps=4)
    return out
