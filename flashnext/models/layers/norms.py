"""RMS norms of the Qwen hybrid family.

`ZeroCenteredRMSNorm` scales by (1 + w), so an all-zero weight is the identity; it can normalise groups
of `group_size` features separately (the hyper-connection streams). `GatedRMSNorm` is GatedDeltaNet's
output norm: a plain weight (no +1) times an activated gate.
"""
import torch
from torch import nn

from flashnext.ops.rms_norm import gated_rms_norm, rms_norm


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
        return gated_rms_norm(x, gate, self.weight, self.eps, self.activation)
