"""The logit edits a request asks for before any sampling: logit_bias, min_tokens and the penalties.

All functions edit `logits` [B, V] float32 in place with tensor ops over the whole batch: no host sync,
no data-dependent shapes, so a decode step that calls them can be captured in a CUDA graph.
Sparse per-request edits come as (rows, cols) index pairs built once per batch composition.
"""
from __future__ import annotations

import torch


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> None:
    """logits[rows[j], cols[j]] += values[j]; rows, cols LongTensor [N], values float32 [N], pairs unique."""
    logits.index_put_((rows, cols), values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     num_generated: torch.Tensor, min_tokens: torch.Tensor) -> None:
    """Forbid the stop token cols[j] of request rows[j] while it has fewer than min_tokens generated tokens.

    num_generated, min_tokens: LongTensor [B]. Adding -inf (rather than writing it) keeps this a single
    accumulate over the index pairs; the rows that have reached their minimum add 0.
    """
    blocked = num_generated[rows] < min_tokens[rows]
    logits.index_put_((rows, cols), torch.where(blocked, float("-inf"), 0.0), accumulate=True)


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor | None, repetition: torch.Tensor,
                    output_counts: torch.Tensor | None, presence: torch.Tensor, frequency: torch.Tensor) -> None:
    """The three penalties, with the semantics of vLLM (and of HF for repetition_penalty).

    seen: bool [B, V], tokens of prompt + output; repetition: float32 [B]. A seen token's logit is divided
    by the penalty when positive, multiplied when not (so a penalty > 1 always makes it less likely).
    output_counts: int32 [B, V], occurrences among generated tokens only (OpenAI);
    presence, frequency: float32 [B]: logit -= frequency * count + presence * (count > 0).
    Either tensor is None when no request of the batch uses that penalty.
    """
    if seen is not None:
        rep = repetition[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))
    if output_counts is not None:
        counts = output_counts.to(logits.dtype)
        logits -= frequency[:, None] * counts + presence[:, None] * (output_counts > 0).to(logits.dtype)
