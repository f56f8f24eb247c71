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


def visible_positions(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                      token_index: torch.Tensor | None = None, token_valid: torch.Tensor | None = None) -> torch.Tensor:
    """[B, W * BS] bool: which positions of each sequence its query attends to."""
    span = block_table.shape[1] * block_size
    pos = torch.arange(span, device=block_table.device)
    visible = pos[None, :] < seq_lens.to(block_table.device)[:, None]
    if token_index is None:
        return visible
    valid = torch.ones_like(token_index, dtype=torch.bool) if token_valid is None else token_valid
    # Adding (not scattering) the flags: an invalid entry may repeat a valid entry's position.
    hits = torch.zeros(visible.shape, dtype=torch.int32, device=visible.device)
    hits.scatter_add_(1, token_index.long(), valid.int())
    return visible & (hits > 0)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               token_index: torch.Tensor | None = None,
                               token_valid: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring for shapes. Reads every page of the table (unused entries must still be
    valid page ids); memory is O(B · W · BS · KVH · D) in fp32."""
    batch, heads, _ = q.shape
    _, block_size, kv_heads, head_dim = k_cache.shape
    span = block_table.shape[1] * block_size
    pos = torch.arange(span, device=q.device)
    rows = block_table.long()[:, pos // block_size] * block_size + pos % block_size           # [B, L]
    k = k_cache.reshape(-1, kv_heads, head_dim)[rows].float().transpose(1, 2)                # [B, KVH, L, D]
    v = v_cache.reshape(-1, kv_heads, head_dim)[rows].float().transpose(1, 2)
    visible = visible_positions(block_table, seq_lens, block_size, token_index, token_valid)  # [B, L]
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
