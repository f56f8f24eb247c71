"""Per-head zero-centred RMSNorm followed by partial RoPE: what attention does to q and k, and the QSA indexer to
its query heads and pooled block keys.

x [N, heads, D] (last dim contiguous; other strides free); weight [D] (the norm scales by 1 + w); cos, sin [N, R]
in x's dtype with R ≤ D (the first R features of every head rotate) → [N, heads, D] in x's dtype.
`norm_rope_reference` is the module math itself (ZeroCenteredRMSNorm, then apply_rotary), rounding where they
round; `norm_rope` sends CUDA tensors to one Triton kernel (ops/norm_rope_triton.py) instead of the ~15 small
kernels of the torch form. FLASHNEXT_NORM_ROPE=reference forces the reference.
"""
from __future__ import annotations

import os

import torch

from flashnext.ops.rms_norm import rms_norm_reference
from flashnext.ops.rope import apply_rotary


def norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    return apply_rotary(rms_norm_reference(x, weight, eps), cos, sin)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if x.is_cuda and os.environ.get("FLASHNEXT_NORM_ROPE", "triton") != "reference":
        from flashnext.ops.norm_rope_triton import norm_rope_triton

        return norm_rope_triton(x, weight, eps, cos, sin)
    return norm_rope_reference(x, weight, eps, cos, sin)
