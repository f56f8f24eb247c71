"""Zero-centred RMSNorm (the weight scales by 1 + w), optionally per group of features.

x [..., dim] → same shape and dtype; weight [dim]; group_size divides dim (None: the whole row).
`rms_norm_reference` is ZeroCenteredRMSNorm's math (models/layers/norms.py), rounding once at the end as it
does; `rms_norm` sends CUDA tensors to one Triton kernel (ops/rms_norm_triton.py) instead of torch's ~8
(cast, square, mean, add, rsqrt, two multiplies, cast) — Qwen3-Next runs 97 of these per decoded token.
`gated_rms_norm_reference` / `gated_rms_norm`: GatedDeltaNet's output norm, the same way.
FLASHNEXT_RMS_NORM=reference forces the reference.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    h = x.float()
    if group_size is not None:
        h = h.reshape(*h.shape[:-1], -1, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if group_size is not None:
        h = h.flatten(-2)
    return (h * (1.0 + weight.float())).type_as(x)


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                             activation: str) -> torch.Tensor:
    """GatedDeltaNet's output norm over the last dim: a plain weight (no +1) times the normed x rounded to its
    dtype, times silu or sigmoid of the gate (models/layers/norms.py GatedRMSNorm)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    g = gate.float()
    g = F.silu(g) if activation == "silu" else torch.sigmoid(g)
    return (h * g).to(dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str) -> torch.Tensor:
    """See gated_rms_norm_reference; CUDA tensors of one dtype → one Triton kernel (prefill: T × heads rows)."""
    if (x.is_cuda and os.environ.get("FLASHNEXT_RMS_NORM", "triton") != "reference"
            and x.dtype == gate.dtype == weight.dtype):
        from flashnext.ops.rms_norm_triton import gated_rms_norm_triton

        return gated_rms_norm_triton(x, gate, weight, eps, activation)
    return gated_rms_norm_reference(x, gate, weight, eps, activation)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    if x.is_cuda and os.environ.get("FLASHNEXT_RMS_NORM", "triton") != "reference":
        from flashnext.ops.rms_norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, group_size)
    return rms_norm_reference(x, weight, eps, group_size)
