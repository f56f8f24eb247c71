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


def route(x: torch.Tensor, weight: torch.Tensor, num_experts: int, top_k: int,
          normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's GEMV and its routing: x [M, K] @ weight [N, K].T, the experts' E rows first (then e.g. the
    shared-expert gate, padding) → (all N logits, weights [M, k], ids [M, k]). With FLASHNEXT_ROUTER_FUSED_TOPK=1, in
    one launch on CUDA for decode-sized inputs (router_gemv_topk_triton; off until measured on the H200:
    `scripts/gpu_decode.py --variant FLASHNEXT_ROUTER_FUSED_TOPK=1`); otherwise decode_linear, then router_topk."""
    from flashnext.ops import linear_gemv_triton
    from flashnext.ops.decode_linear import decode_linear

    if (x.is_cuda and os.environ.get("FLASHNEXT_ROUTER_FUSED_TOPK", "0") == "1"
            and os.environ.get("FLASHNEXT_ROUTER", "triton") != "reference" and linear_gemv_triton.supports(x, weight)):
        from flashnext.ops.router_topk_triton import router_gemv_topk_triton

        return router_gemv_topk_triton(x, weight, num_experts, top_k, normalize)
    logits = decode_linear(x, weight)
    return (logits, *router_topk(logits[..., :num_experts], top_k, normalize))
