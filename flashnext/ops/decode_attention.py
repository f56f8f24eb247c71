"""Paged decode attention: one query token per sequence against its K/V pages.

Shapes (B sequences, H query heads, KVH kv heads, D head dim, NB pages of BS tokens, W pages per table row):
    q [B, H, D]; k_cache, v_cache [NB, BS, KVH, D]; block_table [B, W] (int32/int64); seq_lens [B] (int)
    token_index [B, T] (int), token_valid [B, T] (bool) or None  →  [B, H, D] in q's dtype
Query head h reads kv head h // (H / KVH). Position p of sequence b lives at
k_cache[block_table[b, p // BS], p % BS]. Dense (token_index None): sequence b sees positions
0 .. seq_lens[b] - 1. Sparse (the QSA indexer's selection): it sees the positions token_index[b, t] where
token_valid[b, t] (and position < seq_lens[b]). A sequence that sees nothing (CUDA-graph padding,
seq_lens 0) gets zeros.

`decode_attention_reference` is the specification: gather the rows, mask, SDPA in fp32 (what
GatedAttention._attend computes), round once to q's dtype. `decode_attention` dispatches: CUDA tensors →
the Triton split-K kernel (ops/decode_attention_triton.py), anything else → the reference.
FLASHNEXT_DECODE_ATTENTION=reference forces the reference (to bisect a wrong answer on the GPU).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               token_index: torch.Tensor | None = None,
                               token_valid: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring for shapes. Dense: reads every page of the table (unused entries must still be
    valid page ids). Sparse: reads only the listed tokens, ROW_BLOCK rows at a time, so a long prefill that
    attends one row per query (IndexedAttention) holds O(ROW_BLOCK · T) keys, not O(B · W · BS)."""
    batch = q.shape[0]
    block_size = k_cache.shape[1]
    if token_index is None:
        span = block_table.shape[1] * block_size
        positions = torch.arange(span, device=q.device).expand(batch, span)
        visible = positions < seq_lens.to(q.device)[:, None]
        return _attend(q, k_cache, v_cache, block_table, positions, visible, scale)
    valid = torch.ones_like(token_index, dtype=torch.bool) if token_valid is None else token_valid
    out = torch.empty_like(q)
    for start in range(0, batch, ROW_BLOCK):
        rows = slice(start, start + ROW_BLOCK)
        positions = token_index[rows].long()
        visible = valid[rows] & (positions < seq_lens[rows].to(q.device)[:, None])
        out[rows] = _attend(q[rows], k_cache, v_cache, block_table[rows], positions, visible, scale)
    return out


ROW_BLOCK = 64


def _attend(q, k_cache, v_cache, block_table, positions, visible, scale) -> torch.Tensor:
    """Each row's query over the keys at `positions` [B, L] of its own pages, where `visible` [B, L]; fp32."""
    batch, heads, _ = q.shape
    _, block_size, kv_heads, head_dim = k_cache.shape
    page = torch.gather(block_table.long(), 1, positions // block_size)
    rows = page * block_size + positions % block_size                                        # [B, L]
    k = k_cache.reshape(-1, kv_heads, head_dim)[rows].float().transpose(1, 2)                # [B, KVH, L, D]
    v = v_cache.reshape(-1, kv_heads, head_dim)[rows].float().transpose(1, 2)
    # GQA as G = H / KVH query rows per kv head (= SDPA's enable_gqa, without repeating K/V G times).
    groups = q.float().reshape(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(groups, k, v, attn_mask=visible[:, None, None], scale=scale)
    # SDPA gives NaN for a row that sees nothing; a padded batch slot must stay finite.
    out = torch.where(visible.any(-1)[:, None, None], out.reshape(batch, heads, head_dim), 0.0)
    return out.to(q.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     token_index: torch.Tensor | None = None,
                     token_valid: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring for shapes. CUDA-graph safe on the Triton path."""
    if q.device.type != "cuda" or os.environ.get("FLASHNEXT_DECODE_ATTENTION", "triton") == "reference":
        return decode_attention_reference(q, k_cache, v_cache, block_table, seq_lens, scale, token_index, token_valid)
    from flashnext.ops.decode_attention_triton import split_k_decode_attention

    return split_k_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, token_index, token_valid)
