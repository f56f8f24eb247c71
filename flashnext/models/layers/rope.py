"""Partial rotary position embedding (the first `rotary_dim` features of a head rotate).

The Qwen3.5 / Flash-Next configs declare interleaved mRoPE; for text every position component is the
same, and the interleaving then reduces to plain 1-D RoPE, which is what this computes. Applying the rotation
to heads is ops/rope.py (fused with the q/k norms in ops/norm_rope.py).
"""
import torch
from torch import nn

from flashnext.ops.rope import rope_tables


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] → cos, sin [N, rotary_dim] in `dtype` (rounded like transformers does)."""
        return rope_tables(positions, self.inv_freq, dtype)
