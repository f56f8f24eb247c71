"""QSA indexer block scores at decode: every block slot of each row's (padded) block table, scored by its query.

q [B, Hi, D] (normed and RoPE'd index queries); index_keys [NB, per_page, D] (pooled block keys in the KV
pages); block_table [B, W]; complete_before [B] (blocks complete before each row's query) →
scores [B, W·per_page] fp32 = Σ_heads relu(q_h · key) / √D, −inf for blocks not complete yet.
`qsa_block_scores_reference` gathers the keys through the table and scores them with torch (it materialises
[B, W·per_page, D] fp32); the Triton kernel (ops/qsa_scores_triton.py) reads each key once and writes only
the scores. FLASHNEXT_QSA_SCORES=reference forces the reference.
"""
from __future__ import annotations

import math
import os

import torch


def qsa_block_scores_reference(q: torch.Tensor, index_keys: torch.Tensor, block_table: torch.Tensor,
                               complete_before: torch.Tensor) -> torch.Tensor:
    batch, _, dim = q.shape
    capacity = block_table.shape[1] * index_keys.shape[1]
    keys = index_keys[block_table].view(batch, capacity, dim).float()
    scores = torch.einsum("bhd,bnd->bhn", q.float(), keys).relu().sum(1) / math.sqrt(dim)
    block_ids = torch.arange(capacity, device=q.device)
    return scores.masked_fill(block_ids[None, :] >= complete_before[:, None], float("-inf"))


def qsa_block_scores(q: torch.Tensor, index_keys: torch.Tensor, block_table: torch.Tensor,
                     complete_before: torch.Tensor) -> torch.Tensor:
    if q.is_cuda and os.environ.get("FLASHNEXT_QSA_SCORES", "triton") != "reference":
        from flashnext.ops.qsa_scores_triton import qsa_block_scores_triton

        return qsa_block_scores_triton(q, index_keys, block_table, complete_before)
    return qsa_block_scores_reference(q, index_keys, block_table, complete_before)


def qsa_prefill_scores_reference(q: torch.Tensor, keys: torch.Tensor, complete_before: torch.Tensor) -> torch.Tensor:
    """Prefill: q [T, Hi, D] of many queries against one sequence's block keys [NBLK, D] → scores [T, NBLK] fp32,
    −inf for blocks not complete before each query (complete_before [T])."""
    dim = q.shape[-1]
    scores = torch.einsum("thd,bd->tbh", q.float(), keys.float()).relu().sum(-1) / math.sqrt(dim)
    block_ids = torch.arange(keys.shape[0], device=q.device)
    return scores.masked_fill(block_ids[None, :] >= complete_before[:, None], float("-inf"))


def qsa_prefill_scores(q: torch.Tensor, keys: torch.Tensor, complete_before: torch.Tensor) -> torch.Tensor:
    """See qsa_prefill_scores_reference. CUDA: one Triton kernel on tensor cores (query tiles × key tiles, the heads
    summed in registers) instead of a [T, NBLK, Hi] fp32 product and three passes over it (the product alone is
    1 GiB per 1,024 queries at 262K context, and relu copies it)."""
    if q.is_cuda and os.environ.get("FLASHNEXT_QSA_SCORES", "triton") != "reference":
        from flashnext.ops.qsa_scores_triton import qsa_prefill_scores_triton

        return qsa_prefill_scores_triton(q, keys, complete_before)
    return qsa_prefill_scores_reference(q, keys, complete_before)
