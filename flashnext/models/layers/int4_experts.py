"""Routed experts whose weights stay INT4 in memory (docs/int4.md): forward = ops.moe_int4.

`Int4Experts` is a drop-in for `layers.moe.Experts` (same forward(x, weights, ids)); `quantize_experts_int4`
swaps every `Experts` of a model for one (symmetric RTN), which is what `--quantize int4` does for the
routed experts.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from flashnext.models.layers.int4_linear import Int4Linear
from flashnext.models.layers.moe import Experts
from flashnext.models.stacked import StackedProjection
from flashnext.ops.moe_int4 import SharedExpert, moe_int4, runs_shared_expert, shared_fits
from flashnext.weights.int4_layout import Int4Weight, quantize_rtn

MIN_GROUP_SIZE = 16  # the kernels' smallest K tile (a tile never straddles a group)
_EXPERTS_PER_CHUNK = 64  # quantise this many experts at once: bounds the fp32 temporaries on the real model


def expert_group_size(in_features: int, group_size: int) -> int:
    """`group_size`, or the largest divisor of it that divides K (the tiny test models have K = 32, 64)."""
    g = math.gcd(in_features, group_size)
    if g < MIN_GROUP_SIZE or g % 8:
        raise ValueError(f"cannot quantise experts with K = {in_features} to int4 groups of {group_size}")
    return g


def quantize_stacked(weight: torch.Tensor, group_size: int, compute_device=None) -> Int4Weight:
    """RTN of stacked expert weights [E, N, K] → a stacked Int4Weight ([E, K/8, N] codes) on weight's device,
    rounded on `compute_device` (default: the same) chunk by chunk.

    quantize_rtn treats output rows independently, so E experts are quantised as one [E*N, K] matrix and the
    expert dimension is split off the packed columns afterwards."""
    num_experts, num_out, num_in = weight.shape
    g = expert_group_size(num_in, group_size)
    qweight, scales = [], []
    for chunk in weight.split(_EXPERTS_PER_CHUNK):
        w = quantize_rtn(chunk.to(compute_device or weight.device).reshape(-1, num_in), g)
        qweight.append(w.qweight.view(num_in // 8, len(chunk), num_out).transpose(0, 1).to(weight.device))
        scales.append(w.scales.view(num_in // g, len(chunk), num_out).transpose(0, 1).to(weight.device))
    return Int4Weight(torch.cat(qweight).contiguous(), torch.cat(scales).contiguous(), None, None, g)


class Int4Experts(nn.Module):
    def __init__(self, gate_up: Int4Weight, down: Int4Weight):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = down.qweight.shape[0], down.out_features, down.in_features
        self.group_sizes = (gate_up.group_size, down.group_size)
        self.expert_cache = None  # a LayerExpertCache (flashnext/cache/expert_cache.py): buffers are then its slots
        for prefix, w in (("gate_up", gate_up), ("down", down)):
            for name in ("qweight", "scales", "zeros", "perm"):
                self.register_buffer(f"{prefix}_{name}", getattr(w, name))

    @classmethod
    def from_experts(cls, experts: Experts, group_size: int = 128, compute_device=None) -> Int4Experts:
        return cls(quantize_stacked(experts.gate_up_proj.detach(), group_size, compute_device),
                   quantize_stacked(experts.down_proj.detach(), group_size, compute_device))

    def weight_int4(self, prefix: str) -> Int4Weight:
        """The stacked Int4Weight of "gate_up" ([E, 2I, H]) or "down" ([E, H, I])."""
        g = self.group_sizes[prefix == "down"]
        get = lambda name: getattr(self, f"{prefix}_{name}")  # noqa: E731
        return Int4Weight(get("qweight"), get("scales"), get("zeros"), get("perm"), g)

    def forward(self, x, weights, ids, shared: SharedExpert | None = None):
        """`shared` (from `shared_int4`): the kernels run it as one more expert per token."""
        if self.expert_cache is not None:  # routed ids → slots of the device pool, misses copied in first
            return self.expert_cache.forward(x, weights, ids, shared)
        return moe_int4(x, ids, weights, self.weight_int4("gate_up"), self.weight_int4("down"), shared)

    def decode(self, x, weights, ids, shared: SharedExpert | None = None):
        """The fused kernels need no host sync, so a captured decode step runs `forward` as it is. With an expert
        cache whose pools adapt to graph steps (ExpertCache.enable_graphs), through its slot tables; without, the
        cache runs eagerly."""
        if self.expert_cache is not None:   # through the slot tables when its pools adapt to graph steps
            return self.expert_cache.decode(x, weights, ids, shared)
        return self.forward(x, weights, ids, shared=shared)

    def shared_int4(self, shared_expert, x: torch.Tensor) -> tuple[Int4Weight, Int4Weight] | None:
        """The shared expert's INT4 gate|up and down when the kernels can run it beside these experts for x
        (ops.moe_int4: runs_shared_expert, shared_fits; its gate and up stacked, models/stacked.py); None
        otherwise. With an expert cache too: the shared expert's own weights stay where they are."""
        gate_up, down = getattr(shared_expert, "gate_up", None), getattr(shared_expert, "down_proj", None)
        if (not runs_shared_expert(x) or not isinstance(gate_up, StackedProjection)
                or gate_up.int4 is None or not isinstance(down, Int4Linear) or down.bias is not None):
            return None
        routed = (self.weight_int4("gate_up"), self.weight_int4("down"))
        shared = (gate_up.int4, down.weight_int4)
        return shared if shared_fits(*routed, *shared) else None

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"int4 g{self.group_sizes[0]}/g{self.group_sizes[1]}")


def quantize_experts_int4(model: nn.Module, group_size: int = 128, compute_device=None) -> list[str]:
    """Replace every `Experts` of `model` by Int4Experts (symmetric RTN); returns their names."""
    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, Experts):
            owner_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(owner_name) if owner_name else model, child,
                    Int4Experts.from_experts(module, group_size, compute_device))
            replaced.append(name)
    return replaced
