"""INT4 projections that decode reads get a second layout at load: PyTorch's tinygemm one (ops/w4a16_tinygemm.py),
the faster kernel for bf16 activations of a few rows. Stacked projections (models/stacked.py) get it for their
stacked weight, and their parts, which decode no longer calls, none."""
from __future__ import annotations

import torch
from torch import nn

from flashnext.models.layers.int4_linear import Int4Linear
from flashnext.models.stacked import STACKED_ATTRIBUTES, StackedProjection
from flashnext.ops import w4a16_tinygemm


def attach_decode_forms(model: nn.Module, activation_dtype: torch.dtype) -> tuple[int, int]:
    """Give every eligible INT4 projection its tinygemm form; returns how many, and their bytes. Nothing when the
    activations are not bf16 (tinygemm takes bf16 only) or FLASHNEXT_W4A16_DECODE=triton."""
    if activation_dtype != torch.bfloat16 or not w4a16_tinygemm.enabled():
        return 0, 0
    stacks = [s for m in model.modules() for name in STACKED_ATTRIBUTES
              if isinstance(s := getattr(m, name, None), StackedProjection) and s.int4 is not None]
    stacked_parts = {id(part) for s in stacks for part in s.parts}
    owners = [(stack, stack.int4) for stack in stacks] + [
        (m, m.weight_int4) for m in model.modules() if isinstance(m, Int4Linear) and id(m) not in stacked_parts]
    count = nbytes = 0
    for owner, weight in owners:
        if w4a16_tinygemm.supports(weight):
            owner.decode_form = w4a16_tinygemm.to_tinygemm(weight)
            count += 1
            nbytes += sum(t.numel() * t.element_size() for t in (owner.decode_form.packed,
                                                                 owner.decode_form.scales_and_zeros))
    return count, nbytes
