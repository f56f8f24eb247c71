"""Triton paged prefill attention (flash attention with an online softmax) for ops/prefill_attention.py.

Grid (query tiles, query heads): a program holds BLOCK_M queries of one head and walks the sequence's keys in
tiles of BLOCK_N up to its last query's position (causal), gathering each key tile's rows through the page table
(any page size), so neither the [T, total] scores nor a mask exist in memory. Q·Kᵀ and P·V run on tensor cores
in the inputs' dtype with fp32 accumulation (fp32 inputs: IEEE fp32 dots, for the interpreter tests; on CUDA
ops/prefill_attention.py sends fp32 to the reference); a QSA selection is read as one byte per (query, block of
`ratio` tokens) inside the loop. Heavy tiles (the last queries see the most keys) are scheduled first. Results
differ from the reference only by summation order and P's rounding to q's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T", "context_len", "n_chosen", "stride_ct"])
def _prefill_attention_kernel(q_ptr, k_ptr, v_ptr, blocks_ptr, chosen_ptr, out_ptr,
                              T, context_len, n_chosen, stride_qt, stride_qh, stride_ot, stride_oh, stride_ct, scale,
                              GROUP: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                              RATIO: tl.constexpr, HAS_CHOSEN: tl.constexpr, FP32: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T
    pos = context_len + offs_m
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=m_ok[:, None],
                other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    tail_start = (pos + 1) // RATIO * RATIO
    end = context_len + tl.minimum((pid_m + 1) * BLOCK_M, T)   # one past the tile's last query position
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        page = tl.load(blocks_ptr + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        kv_offs = (page * PAGE + offs_n % PAGE)[:, None] * (KV_HEADS * D) + kv_head * D + offs_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=n_ok[:, None], other=0.0)
        visible = offs_n[None, :] <= pos[:, None]
        if HAS_CHOSEN:   # loaded before the dot, whose MMA then covers the load's latency (Triton does not pipeline it)
            block = offs_n // RATIO
            picked = tl.load(chosen_ptr + offs_m[:, None] * stride_ct + block[None, :],
                             mask=m_ok[:, None] & (block < n_chosen)[None, :], other=0)
            visible = visible & ((picked != 0) | (offs_n[None, :] >= tail_start[:, None]))
        if FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(visible, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row that has seen nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_offs, mask=n_ok[:, None], other=0.0)
        if FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_config(head_dim: int, device: torch.device) -> PrefillConfig:
    """Head dim 256 (Flash-Next, Qwen3-Next): 128 × 64 tiles, 8 warps, 3 stages, with or without a QSA selection
    (each step then also reads the selection's bytes, a plain load). With 2 stages Triton issues a K/V tile's
    copies at the end of the step before the one that waits for them (their latency exposed each step); 3 stages
    (~200 KB of shared memory) issue them a step earlier. The H200 (scripts/gpu_prefill_attention.py): dense 8K
    queries 1.64 ms at 128 × 64 × 3, its best (session 16); QSA 8K queries from 0 / 2K after 8K 6.55 / 3.75 ms at
    128 × 64 × 3 against 7.04 / 4.07 at 64 × 32 × 4 × 2 (session 18, 64d5a88). Session 16 had measured 5.89 / 3.39 at
    64 × 32 and chose it; since its last changes to the kernel (lengths and the selection's row stride passed
    unspecialised, against recompiles) 64 × 32 has been slower, and giving the stride back its specialisation
    (rows padded to 16 blocks: 4.07 / 7.04 ms, session 18) did not restore it — the cause is not known.
    Smaller heads (tiny test models) keep 64 × 64."""
    if device.type != "cuda":
        return PrefillConfig(16, 16, 4, 1)
    if head_dim > 128:
        return PrefillConfig(128, 64, 8, 3)
    return PrefillConfig(64, 64, 4, 3)


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                             context_len: int, scale: float, chosen: torch.Tensor | None = None, ratio: int = 1,
                             config: PrefillConfig | None = None) -> torch.Tensor:
    """See ops/prefill_attention.py."""
    length, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    assert head_dim == triton.next_power_of_2(head_dim) and heads % kv_heads == 0, (heads, kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert blocks.numel() * page >= context_len + length
    out = torch.empty(length, heads, head_dim, dtype=q.dtype, device=q.device)
    if length == 0:
        return out
    cfg = config or default_config(head_dim, q.device)
    if chosen is not None:
        chosen = chosen.contiguous().view(torch.uint8)
    selection = chosen if chosen is not None else blocks   # a pointer never read without a selection
    grid = (triton.cdiv(length, cfg.block_m), heads)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, blocks, selection, out,
        length, context_len, chosen.shape[1] if chosen is not None else 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), selection.stride(0), scale,
        GROUP=heads // kv_heads, KV_HEADS=kv_heads, D=head_dim, PAGE=page, RATIO=ratio,
        HAS_CHOSEN=chosen is not None, FP32=q.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
