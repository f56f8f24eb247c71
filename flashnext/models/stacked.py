"""Projections that read the same input, stacked into one matrix so that one kernel computes them all.

A captured Flash-Next decode step is ~3,000 kernels; small projections of one input (GatedDeltaNet's b and a,
and its qkv and z; attention's q, k and v; the router and the shared-expert gate, the shared expert's gate and
up) each cost a launch and a latency-bound GEMV of their own. Their outputs come back as column slices of one
result (row stride the stacked width): the kernels that read them take any row stride. `stack_projections(model)` — run once the model sits on its final device,
after loading and sharding — gives the owning modules a `StackedProjection` that they call instead. The
modules and their checkpoint keys stay as they are: 16-bit weights become row views of the stacked matrix
(no copy); INT4 weights are concatenated along N and the parts keep column views of the result (their own
copies are freed).
"""
from __future__ import annotations

import torch
from torch import nn

from flashnext.models.layers.int4_linear import Int4Linear
from flashnext.ops.decode_linear import decode_linear
from flashnext.ops.w4a16 import w4a16_linear
from flashnext.weights.int4_layout import Int4Weight


class StackedProjection:
    def __init__(self, *modules: nn.Module):
        if any(getattr(m, "bias", None) is not None for m in modules):
            raise ValueError("stacked projections have no bias")
        self.int4: Int4Weight | None = None
        self.decode_form = None   # the INT4 weight in tinygemm's layout, for decode (models/decode_forms.py)
        self.weight: torch.Tensor | None = None
        self.parts = modules
        self.padding = 0          # zero rows after the parts (16-bit weights)
        if all(isinstance(m, Int4Linear) for m in modules):
            weights = [m.weight_int4 for m in modules]
            first = weights[0]
            if any(w.perm is not None or w.group_size != first.group_size or (w.zeros is None) != (first.zeros is None)
                   for w in weights):
                raise ValueError("INT4 projections stack only without act-order and with one group size and zero form")
            self.sizes = [w.out_features for w in weights]
            cat = lambda name: torch.cat([getattr(w, name) for w in weights], dim=1)  # noqa: E731
            self.int4 = Int4Weight(cat("qweight"), cat("scales"), None if first.zeros is None else cat("zeros"), None,
                                   first.group_size)
            # The parts keep column views of the stacked tensors instead of their own copies (Flash-Next: ~1.1 GB);
            # nothing calls them once stacked, and a call would take the reference (the kernels want contiguous N).
            start = 0
            for m, size in zip(modules, self.sizes):
                for name, stacked in self.int4.tensors().items():
                    setattr(m, name, stacked[:, start: start + size])
                start += size
        elif not any(isinstance(m, Int4Linear) for m in modules):
            self.sizes = [m.weight.shape[0] for m in modules]
            # Zero rows up to a multiple of ROW_ALIGN: the router and the shared-expert gate are 513 rows, and
            # cuBLAS took an unaligned sm75 kernel for that width in prefill (0.19 ms per 8,192-token layer on
            # the H200, ~4× an aligned GEMM); the padding's outputs are dropped.
            pad = -sum(self.sizes) % ROW_ALIGN
            first = modules[0].weight
            self.weight = torch.cat([m.weight.detach() for m in modules] + [first.new_zeros(pad, first.shape[1])])
            for m, view in zip(modules, self.weight.split(self.sizes + [pad])):
                m.weight = nn.Parameter(view, requires_grad=False)
            self.padding = pad
        else:
            raise ValueError("cannot stack INT4 and 16-bit projections")

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = decode_linear(x, self.weight) if self.int4 is None else w4a16_linear(x, self.int4, self.decode_form)
        if self.padding:
            return y.split(self.sizes + [self.padding], dim=-1)[:-1]
        return y.split(self.sizes, dim=-1)


ROW_ALIGN = 8   # 16-bit stacks are padded to this many rows (16 bytes of bf16 output per row)
STACKED_ATTRIBUTES = ("project_ba", "project_qkvz", "project_qkv", "route_and_gate", "gate_up")


def unstack_projections(model: nn.Module) -> None:
    """Drop every stacked form: whoever replaces a projection module (quantising) calls this first, or the
    stale stacked weights would keep being used."""
    for module in model.modules():
        for name in STACKED_ATTRIBUTES:
            stack = getattr(module, name, None)
            if isinstance(stack, StackedProjection):
                if stack.int4 is not None:   # the parts' column views become weights of their own again
                    for part in stack.parts:
                        for tensor_name in stack.int4.tensors():
                            setattr(part, tensor_name, getattr(part, tensor_name).contiguous())
                setattr(module, name, None)


def stack_projections(model: nn.Module) -> int:
    """Give every module with projections of one input its stacked form; returns how many were stacked."""
    from flashnext.models.layers.attention import GatedAttention
    from flashnext.models.layers.gated_delta_net import GatedDeltaNet
    from flashnext.models.layers.moe import DenseMLP, SparseMoe

    count = 0
    for module in model.modules():
        groups = []
        if isinstance(module, GatedDeltaNet) and module.split:
            groups = [("project_ba", module.in_proj_b, module.in_proj_a),
                      ("project_qkvz", module.in_proj_qkv, module.in_proj_z)]
        elif isinstance(module, GatedAttention):
            groups = [("project_qkv", module.q_proj, module.k_proj, module.v_proj)]
        elif isinstance(module, SparseMoe):
            groups = [("route_and_gate", module.gate, module.shared_expert_gate)]
        elif isinstance(module, DenseMLP):
            groups = [("gate_up", module.gate_proj, module.up_proj)]
        for name, *parts in groups:
            try:
                setattr(module, name, StackedProjection(*parts))
                count += 1
            except ValueError:
                pass  # e.g. act-order INT4 or a bias: the projections keep running one by one
    return count
