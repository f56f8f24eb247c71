"""RMS norms of the Qwen hybrid family.

`ZeroCenteredRMSNorm` scales by (1 + w), so an all-zero weight is the identity; it can normalise groups
of `group_size` features separately (the hyper-connection streams). `GatedRMSNorm` is GatedDeltaNet's
output norm: a plain weight (no +1) times an activated gate.
"""
import torch
import torch.nn.functional as F
from torch import nn

from flashnext.ops.rms_norm import rms_norm


class ZeroCenteredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, group_size: int | None = None):
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 inside, one rounding at the end: transformers does the same and bf16 parity depends on it
        # (ops/rms_norm.py: the math, and one kernel for it on the GPU).
        return rms_norm(x, self.weight, self.eps, self.group_size)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        self.eps = eps
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        g = gate.float()
        g = F.silu(g) if self.activation == "silu" else torch.sigmoid(g)
        return (h * g).to(dtype)
