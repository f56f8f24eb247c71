"""Causal depthwise 1-D convolution with a carried tail, as a torch reference.

x [..., T, C]; weight [C, K]; tail [..., span, C] with span = (K-1)·dilation (the previous inputs, zeros for a
fresh sequence); leading dims are independent sequences. Returns (silu(conv(x)) [..., T, C], new tail
[..., span, C]). `dilation` spaces the taps (PLE uses 3).
"""
import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor, dilation: int = 1):
    span, length, channels = tail.shape[-2], x.shape[-2], x.shape[-1]
    full = torch.cat([tail.to(x.dtype), x], dim=-2)                  # [..., span + T, C]
    rows = full.reshape(-1, span + length, channels).transpose(1, 2).to(weight.dtype)
    out = F.conv1d(rows, weight.unsqueeze(1), groups=channels, dilation=dilation)   # [B, C, T]
    out = F.silu(out.transpose(1, 2)).reshape(x.shape)
    return out.to(x.dtype), full[..., -span:, :].clone()
