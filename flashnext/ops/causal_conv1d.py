"""Causal depthwise 1-D convolution with a carried tail, as a torch reference.

x [T, C]; weight [C, K]; tail [K-1, C] (the previous inputs, zeros for a fresh sequence). Returns
(silu(conv(x)) [T, C], new tail [K-1, C]). `dilation` spaces the taps (PLE uses 3).
"""
import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor, dilation: int = 1):
    span = tail.shape[0]
    full = torch.cat([tail.to(x.dtype), x], dim=0)           # [span + T, C]
    out = F.conv1d(full.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=x.shape[1], dilation=dilation)
    out = F.silu(out[0].t()[-x.shape[0]:])
    return out.to(x.dtype), full[-span:].clone()
