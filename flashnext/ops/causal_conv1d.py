"""Causal depthwise 1-D convolution with a carried tail.

x [..., T, C]; weight [C, K]; tail [..., span, C] with span = (K-1)·dilation (the previous inputs, zeros for a
fresh sequence); leading dims are independent sequences. Returns (silu(conv(x)) [..., T, C], new tail
[..., span, C]). `dilation` spaces the taps (PLE uses 3).

`causal_conv1d_reference` is the specification (cuDNN's depthwise conv in the weight's dtype, silu, x's dtype).
`causal_conv1d` sends one CUDA sequence (prefill: x [T, C]) to a Triton kernel (ops/causal_conv1d_triton.py:
the taps read straight from the tail and x, no concatenated and transposed copies; cuDNN's depthwise kernel
took ~3% of a 10K Flash-Next prefill on the H200); batched leading dims and everything else → the reference.
FLASHNEXT_CONV=reference forces the reference.
"""
import os

import torch
import torch.nn.functional as F


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor, dilation: int = 1):
    span, length, channels = tail.shape[-2], x.shape[-2], x.shape[-1]
    full = torch.cat([tail.to(x.dtype), x], dim=-2)                  # [..., span + T, C]
    rows = full.reshape(-1, span + length, channels).transpose(1, 2).to(weight.dtype)
    out = F.conv1d(rows, weight.unsqueeze(1), groups=channels, dilation=dilation)   # [B, C, T]
    out = F.silu(out.transpose(1, 2)).reshape(x.shape)
    return out.to(x.dtype), full[..., -span:, :].clone()


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor, dilation: int = 1):
    if x.is_cuda and x.dim() == 2 and os.environ.get("FLASHNEXT_CONV", "triton") != "reference":
        from flashnext.ops.causal_conv1d_triton import causal_conv1d_triton

        return causal_conv1d_triton(x, weight, tail, dilation)
    return causal_conv1d_reference(x, weight, tail, dilation)
