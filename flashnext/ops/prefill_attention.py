"""Paged prefill attention: the queries of one prompt segment against every earlier token of its sequence.

Shapes (T queries at positions context_len .. context_len + T - 1, H query heads, KVH kv heads, D head dim,
pages of BS tokens):
    q [T, H, D]; k_cache, v_cache [NB, BS, KVH, D] (the segment's own K/V already written);
    blocks [W] page ids of the sequence (position p lives at k_cache[blocks[p // BS], p % BS])
    chosen [T, NBLK] bool or None: the QSA indexer's selection of complete blocks of `ratio` tokens
→ [T, H, D] in q's dtype. Query head h reads kv head h // (H / KVH).
Query t at position p sees token j iff j <= p and, with a selection, j lies in the tail of p's incomplete block
(j >= ((p + 1) // ratio) · ratio) or chosen[t, j // ratio] (chosen covers only blocks complete before p).

`prefill_attention_reference` is the specification: gather the sequence's rows, SDPA over QUERY_BLOCK queries at
a time with the visibility mask (memory O(QUERY_BLOCK · total)). `prefill_attention` dispatches: bf16/fp16 CUDA
tensors → the Triton flash-attention kernel (ops/prefill_attention_triton.py: bf16 tensor cores, online softmax,
no mask or score matrix in memory), anything else → the reference. fp32 on CUDA takes the reference too: ptxas
spent over 100 s on the kernel's IEEE-fp32 tiles on the H200 (session 5, two exactness scripts cut by their time
limits inside that compile), and fp32 serves only exactness checks, where SDPA is the better oracle anyway.
FLASHNEXT_PREFILL_ATTENTION=reference forces the reference (to bisect a wrong answer on the GPU).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

QUERY_BLOCK = 1024


def selection_mask(chosen: torch.Tensor, query_pos: torch.Tensor, total: int, ratio: int) -> torch.Tensor:
    """chosen [n, NBLK] complete blocks per query → token visibility [n, total] (before the causal mask): the
    chosen blocks' tokens and the tail of each query's incomplete block."""
    token = torch.arange(total, device=chosen.device)
    complete_before = (query_pos + 1) // ratio
    picked = torch.zeros(chosen.shape[0], total, dtype=torch.bool, device=chosen.device)
    picked[:, : chosen.shape[1] * ratio] = chosen.repeat_interleave(ratio, dim=1)
    return picked | (token[None, :] >= complete_before[:, None] * ratio)


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                                context_len: int, scale: float, chosen: torch.Tensor | None = None,
                                ratio: int = 1) -> torch.Tensor:
    """See the module docstring."""
    length = q.shape[0]
    _, block_size, kv_heads, head_dim = k_cache.shape
    total = context_len + length
    token = torch.arange(total, device=q.device)
    rows = blocks.long()[token // block_size] * block_size + token % block_size
    k = k_cache.reshape(-1, kv_heads, head_dim)[rows].transpose(0, 1)          # [KVH, total, D]
    v = v_cache.reshape(-1, kv_heads, head_dim)[rows].transpose(0, 1)
    out = torch.empty_like(q)
    for start in range(0, length, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, length)
        query_pos = context_len + torch.arange(start, end, device=q.device)
        visible = token[None, :] <= query_pos[:, None]
        if chosen is not None:
            visible &= selection_mask(chosen[start:end], query_pos, total, ratio)
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k, v, attn_mask=visible, scale=scale,
                                           enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                      context_len: int, scale: float, chosen: torch.Tensor | None = None,
                      ratio: int = 1) -> torch.Tensor:
    """See the module docstring."""
    if (q.device.type != "cuda" or q.dtype == torch.float32
            or os.environ.get("FLASHNEXT_PREFILL_ATTENTION", "triton") == "reference"):
        return prefill_attention_reference(q, k_cache, v_cache, blocks, context_len, scale, chosen, ratio)
    from flashnext.ops.prefill_attention_triton import prefill_attention_triton

    return prefill_attention_triton(q, k_cache, v_cache, blocks, context_len, scale, chosen, ratio)
