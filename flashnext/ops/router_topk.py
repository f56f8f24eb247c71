"""MoE routing from router logits: fp32 softmax over the experts, top-k, optional renormalisation.

logits [M, E] (the router's output, activation dtype) → (weights [M, k] in the logits' dtype, ids [M, k] int64),
as transformers' routers compute it. `router_topk_reference` is the specification; `router_topk` sends CUDA
tensors to one Triton kernel (ops/router_topk_triton.py) instead of torch's softmax, top-k (a sort for
E = 512), sum, divide and cast: ~7 launches and the slowest of them a sort. Ties (equal probabilities) may pick
either expert. FLASHNEXT_ROUTER=reference forces the reference.
"""
from __future__ import annotations

import os

import torch


def router_topk_reference(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def router_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.is_cuda and logits.dim() == 2 and os.environ.get("FLASHNEXT_ROUTER", "triton") != "reference":
        from flashnext.ops.router_topk_triton import router_topk_triton

        return router_topk_triton(logits, top_k, normalize)
    return router_topk_reference(logits, top_k, normalize)
