"""A linear layer whose weight stays INT4 in memory (docs/int4.md): forward = W4A16 matmul (+ bias)."""
from __future__ import annotations

import torch
from torch import nn

from flashnext.ops.w4a16 import w4a16_linear
from flashnext.weights.int4_layout import Int4Weight


class Int4Linear(nn.Module):
    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None):
        super().__init__()
        self.group_size = weight.group_size
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.register_buffer("perm", weight.perm)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.decode_form = None   # the weight in tinygemm's layout, for decode (models/decode_forms.py)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128) -> Int4Linear:
        from flashnext.weights.int4_layout import quantize_rtn

        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(quantize_rtn(linear.weight, group_size), bias)

    @property
    def weight_int4(self) -> Int4Weight:
        return Int4Weight(self.qweight, self.scales, self.zeros, self.perm, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = w4a16_linear(x, self.weight_int4, self.decode_form)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        sym = "sym" if self.zeros is None else "asym"
        order = ", act-order" if self.perm is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{self.group_size} {sym}{order}"
