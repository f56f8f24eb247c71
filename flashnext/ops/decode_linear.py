"""A bias-free linear of a 16-bit weight whose decode call is latency-bound (the stacked router|shared-expert gate
and GatedDeltaNet's b|a: models/stacked.py). CUDA inputs of up to MAX_ROWS rows and weights of up to
MAX_WEIGHT_BYTES take the Triton GEMV (ops/linear_gemv_triton.py); anything else (the stacks of a 16-bit model's
big projections included), and FLASHNEXT_DECODE_LINEAR=reference, F.linear (the reference)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def decode_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T → [..., N] in x's dtype."""
    if x.is_cuda and os.environ.get("FLASHNEXT_DECODE_LINEAR", "triton") != "reference":
        from flashnext.ops import linear_gemv_triton

        rows = x.reshape(-1, x.shape[-1])
        if linear_gemv_triton.supports(rows, weight):
            return linear_gemv_triton.linear_gemv(rows, weight).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)
