"""INT4 projections that decode reads get a second layout at load: PyTorch's tinygemm one (ops/w4a16_tinygemm.py),
the faster kernel for bf16 activations of a few rows. Stacked projections (models/stacked.py) get it for their
stacked weight, and their parts, which decode no longer calls, none."""
from __future__ import annotations

import torch
from torch import nn

from flashnext.models.layers.int4_linear import Int4Linear
from flashnext.models.stacked import STACKED_ATTRIBUTES, StackedProjection
from flashnext.ops import w4a16_tinygemm


def attach_decode_forms(model: nn.Module, activation_dtype: torch.dtype) -> int:
    """Give every eligible INT4 projection its tinygemm form; returns how many. Nothing when the activations are
    not bf16 (tinygemm takes bf16 only) or FLASHNEXT_W4A16_DECODE=triton."""
    if activation_dtype != torch.bfloat16 or not w4a16_tinygemm.enabled():
        return 0
    stacks = [s for m in model.modules() for name in STACKED_ATTRIBUTES
              if isinstance(s := getattr(m, name, None), StackedProjection) and s.int4 is not None]
    stacked_parts = {id(part) for s in stacks for part in s.parts}
    count = 0
    for stack in stacks:
        if w4a16_tinygemm.supports(stack.int4):
            stack.decode_form = w4a16_tinygemm.to_tinygemm(stack.int4)
            count += 1
    for module in model.modules():
        if isinstance(module, Int4Linear) and id(module) not in stacked_parts:
            weight = module.weight_int4
            if w4a16_tinygemm.supports(weight):
                module.decode_form = w4a16_tinygemm.to_tinygemm(weight)
                count += 1
    return count
