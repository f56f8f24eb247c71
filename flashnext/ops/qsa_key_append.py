"""The QSA indexer's decode-time key bookkeeping: one new raw key per row joins its sequence's current block.

Per row b (position p, slot s, offset o = p mod r, r = compress ratio): the pooled key of the block that starts at
p − o — the fp32 mean of the r − 1 raw keys held in the slot's ring and the new one, rounded to the keys' dtype,
zero-centred-RMS-normed and RoPE'd at p − o — is written to that block's row of `index_keys` (through the block
table); it is final once o = r − 1, and until then the row belongs to an incomplete block nobody reads. The new
raw key goes into ring[s, o] unless the block is now complete. In place; shapes:
    raw [B, D]; ring [S, r−1, D]; slots, positions [B]; block_table [B, W]; index_keys [NB, per_page, D];
    norm_weight [D]; inv_freq [R/2] (RoPE on the first R features).
`qsa_key_append_reference` is the torch form (the ops of QSAIndexer.decode before this op existed); the Triton
kernel (ops/qsa_key_append_triton.py) does it in one launch instead of ~25. FLASHNEXT_QSA_KEY=reference forces it.
Rows that are one sequence's consecutive tokens (`chained`, a chained decode batch) are the reference applied row
after row (`qsa_key_append_chain_reference`); the Triton form does them in two launches and writes keys only for
the blocks its rows complete.
"""
from __future__ import annotations

import os

import torch

from flashnext.ops.norm_rope import norm_rope_reference
from flashnext.ops.rope import rope_tables


def qsa_key_append_reference(raw, ring, slots, positions, block_table, index_keys, norm_weight, eps, inv_freq) -> None:
    r = ring.shape[1] + 1
    dim = raw.shape[-1]
    offset = positions % r
    held = ring[slots]                                                             # [B, r-1, D]
    pooled = torch.cat([held, raw[:, None, :]], dim=1).float().mean(dim=1).to(raw.dtype)
    cos, sin = rope_tables(positions - offset, inv_freq, raw.dtype)
    key = norm_rope_reference(pooled[:, None, :], norm_weight, eps, cos, sin)[:, 0]
    per_page = index_keys.shape[1]
    block = positions // r
    page = torch.gather(block_table, 1, (block // per_page)[:, None])[:, 0]
    index_keys.view(-1, dim).index_copy_(0, page * per_page + block % per_page, key)
    at = offset.clamp(max=r - 2)
    kept = held.gather(1, at[:, None, None].expand(-1, 1, dim))[:, 0]
    ring[slots, at] = torch.where((offset == r - 1)[:, None], kept, raw)


def qsa_key_append_chain_reference(raw, ring, slots, positions, block_table, index_keys, norm_weight, eps,
                                   inv_freq) -> None:
    """Rows that are one sequence's consecutive tokens (a chained decode batch): appended one after the other."""
    for row in range(raw.shape[0]):
        rows = slice(row, row + 1)
        qsa_key_append_reference(raw[rows], ring, slots[rows], positions[rows], block_table[rows], index_keys,
                                 norm_weight, eps, inv_freq)


def qsa_key_append(raw, ring, slots, positions, block_table, index_keys, norm_weight, eps, inv_freq,
                   chained: bool = False) -> None:
    """`chained`: the rows are one sequence's consecutive tokens; the Triton form appends them in two launches (its
    module docstring), leaving the same pooled keys of complete blocks and the same ring as the reference's loop."""
    if raw.is_cuda and os.environ.get("FLASHNEXT_QSA_KEY", "triton") != "reference":
        from flashnext.ops.qsa_key_append_triton import qsa_key_append_triton

        return qsa_key_append_triton(raw, ring, slots, positions, block_table, index_keys, norm_weight, eps, inv_freq,
                                     chained=chained)
    reference = qsa_key_append_chain_reference if chained else qsa_key_append_reference
    return reference(raw, ring, slots, positions, block_table, index_keys, norm_weight, eps, inv_freq)
