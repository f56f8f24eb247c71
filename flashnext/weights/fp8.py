"""Block-FP8 weights (DeepSeek-V3 / Qwen FP8 releases).

`weight` float8_e4m3fn [..., N, K] with `weight_scale_inv` float32 [..., ceil(N/bn), ceil(K/bk)] (block 128x128
in every release so far): w = fp8.float() * scale of its block. A single-element scale (per-tensor FP8, e.g.
a PLE table) applies to the whole tensor.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def expand_block_scale(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Scales of [ceil(N/bn), ceil(K/bk)] blocks (any leading dims) → one a weight of `shape` [..., N, K]."""
    rows, cols = shape[-2], shape[-1]
    expanded = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return expanded[..., :rows, :cols]


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """fp8 [..., N, K] and its block scales -> fp32 [..., N, K]."""
    w = weight.float()
    scale_inv = scale_inv.float().to(w.device)
    if scale_inv.numel() == 1:
        return w * scale_inv.reshape(())
    expected = (*weight.shape[:-2], math.ceil(weight.shape[-2] / block[0]), math.ceil(weight.shape[-1] / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} "
            f"with {block[0]}x{block[1]} blocks (expected {expected})"
        )
    return w * expand_block_scale(scale_inv, weight.shape, block)


def quantize_block_fp8(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (fp8 weight, fp32 scale_inv [..., ceil(N/bn), ceil(K/bk)]) with scale = block amax / 448."""
    w = weight.detach().float()
    rows, cols = w.shape[-2], w.shape[-1]
    pad_rows, pad_cols = -rows % block[0], -cols % block[1]
    padded = torch.nn.functional.pad(w, (0, pad_cols, 0, pad_rows))
    blocks = padded.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))  # [..., nb, bn, kb, bk]
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    q = (w / expand_block_scale(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
