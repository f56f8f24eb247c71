"""`quantize_dense_int4`: keep a model's dense projections INT4 in memory (`--quantize int4`; docs/int4.md).

Which projections, and why: the GatedDeltaNet and attention projections and the shared expert (or dense MLP)
are the bulk of the non-expert bytes a decode step reads, and what released INT4 checkpoints quantise.
lm_head, the router, shared_expert_gate, in_proj_b/a/ba, hyper-connection mixers, PLE and the QSA indexer stay
in the model dtype: they are small, or steer routing/gating where rounding errors are amplified.
"""
from __future__ import annotations

import logging
import math

from torch import nn

from flashnext.models.layers.attention import GatedAttention
from flashnext.models.layers.gated_delta_net import GatedDeltaNet
from flashnext.models.layers.int4_linear import Int4Linear
from flashnext.models.layers.moe import DenseMLP
from flashnext.weights.int4_layout import Int4Weight

log = logging.getLogger(__name__)

# Owner module type → the names of its children that become INT4.
INT4_PROJECTIONS: dict[type, tuple[str, ...]] = {
    GatedDeltaNet: ("in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj"),
    GatedAttention: ("q_proj", "k_proj", "v_proj", "o_proj"),
    DenseMLP: ("gate_proj", "up_proj", "down_proj"),
}
MIN_GROUP_SIZE = 16


def group_size_for(in_features: int, group_size: int) -> int | None:
    """`group_size`, or the largest power of two dividing both it and K (tiny test models have K = 32, 64);
    None when that is below 16 rows (the kernels' smallest K tile)."""
    g = math.gcd(in_features, group_size)
    return g if g >= MIN_GROUP_SIZE else None


def dense_int4_targets(model: nn.Module) -> list[str]:
    """Names of the nn.Linear modules that the INT4 choice above covers (whatever their sizes)."""
    found = []
    for owner_name, owner in model.named_modules():
        names = next((n for cls, n in INT4_PROJECTIONS.items() if isinstance(owner, cls)), ())
        found += [f"{owner_name}.{n}" for n in names if isinstance(getattr(owner, n, None), nn.Linear)]
    return found


def int4_expert_keys(model: nn.Module) -> list[str]:
    """The state-dict keys of every routed-expert set (fused gate_up_proj and down_proj): loaded packed when the
    checkpoint stores them as 4-bit GPTQ (docs/int4.md)."""
    from flashnext.models.layers.moe import Experts

    return [f"{name}.{kind}" for name, m in model.named_modules() if isinstance(m, Experts)
            for kind in ("gate_up_proj", "down_proj")]


def use_int4_weights(model: nn.Module, weights: dict) -> list[str]:
    """Swap in an Int4Linear for every `X.weight` of `weights` that is an Int4Weight (a checkpoint's packed
    projection), an Int4Experts for every expert set whose two stacked weights are, and put their packed
    tensors into `weights` under the new modules' keys; returns the names."""
    from flashnext.models.layers.int4_experts import Int4Experts
    from flashnext.weights.int4_layout import dequantize

    swapped = []
    for name in {k.rsplit(".", 1)[0] for k in int4_expert_keys(model)}:
        gate_up, down = weights.get(f"{name}.gate_up_proj"), weights.get(f"{name}.down_proj")
        if not isinstance(gate_up, Int4Weight) and not isinstance(down, Int4Weight):
            continue
        if not (isinstance(gate_up, Int4Weight) and isinstance(down, Int4Weight)):
            # One half fell back to 16-bit (act-order pieces): the set stays 16-bit, the other half dequantised.
            plain = down if isinstance(gate_up, Int4Weight) else gate_up
            for kind in ("gate_up_proj", "down_proj"):
                if isinstance(weights[f"{name}.{kind}"], Int4Weight):
                    weights[f"{name}.{kind}"] = dequantize(weights[f"{name}.{kind}"]).to(plain.dtype)
            continue
        del weights[f"{name}.gate_up_proj"], weights[f"{name}.down_proj"]
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, Int4Experts(gate_up, down))
        for prefix, w in (("gate_up", gate_up), ("down", down)):
            weights.update({f"{name}.{prefix}_{k}": v for k, v in w.tensors().items()})
        swapped.append(name)
    for key in [k for k, v in weights.items() if isinstance(v, Int4Weight)]:
        name = key.removesuffix(".weight")
        packed = weights.pop(key)
        parent, _, child = name.rpartition(".")
        bias = weights.get(f"{name}.bias")
        setattr(model.get_submodule(parent), child, Int4Linear(packed, None if bias is None else bias.clone()))
        weights.update({f"{name}.{k}": v for k, v in packed.tensors().items()})
        swapped.append(name)
    return swapped


def quantize_dense_int4(model: nn.Module, group_size: int = 128) -> list[str]:
    """Replace the dense projections of `model` by Int4Linear (symmetric RTN); returns their names."""
    from flashnext.models.stacked import unstack_projections

    unstack_projections(model)
    replaced = []
    for full in dense_int4_targets(model):
        parent, _, name = full.rpartition(".")
        owner = model.get_submodule(parent)
        linear = getattr(owner, name)
        g = group_size_for(linear.in_features, group_size)
        if g is None or linear.out_features % 8:
            log.info("keeping %s [%d, %d] unquantised: no int4 group size fits", full, linear.out_features,
                     linear.in_features)
            continue
        setattr(owner, name, Int4Linear.from_linear(linear, g))
        replaced.append(full)
    return replaced


def quantize_experts_int4(model: nn.Module, group_size: int = 128, compute_device=None) -> list[str]:
    """Replace every routed `Experts` of `model` by Int4Experts (symmetric RTN per expert); returns their names.
    The MoE side of `--quantize int4` (flashnext/models/layers/int4_experts.py). compute_device: where to round
    (chunk by chunk) experts that live elsewhere, e.g. in host memory; the codes stay where the experts were."""
    from flashnext.models.layers.int4_experts import quantize_experts_int4 as replace_experts

    return replace_experts(model, group_size, compute_device)
