"""GatedDeltaNet decode step: one new token for each of B sequences, from the projections to the gated norm.

Shapes (B rows, S state slots, C = 2·Hk·Dk + Hv·Dv conv channels):
    mixed_qkv [B, C] as [all q | all k | all v]; z [B, Hv, Dv]; b, a [B, Hv]   (x dtype)
    conv_state [S, K-1, C] (x dtype), ssm_state [S, Hv, Dk, Dv] fp32: read and updated in place at `slots` [B]
    conv_weight [C, K], A_log [Hv], dt_bias [Hv], norm_weight [Dv]
    → out [B, Hv·Dv] in x dtype (the input of out_proj)
It is GatedDeltaNet.forward for B one-token segments: causal conv with the carried tail (silu), l2-normalised
q and k (q scaled by Dk^-½), the gated delta rule (ops/gated_delta_rule.py) and GatedRMSNorm(o, z).

`gdn_decode_reference` is the specification: the layer's own torch references, so it rounds where the layer
rounds (the conv output and o to x's dtype, β = sigmoid(b) in x's dtype, the norm's `weight * h.to(dtype)`). `gdn_decode` dispatches: CUDA
tensors → the Triton kernels (ops/gdn_decode_triton.py), anything else → the reference.
FLASHNEXT_GDN_DECODE=reference forces the reference (to bisect a wrong answer on the GPU).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from flashnext.ops.causal_conv1d import causal_conv1d_reference
from flashnext.ops.gated_delta_rule import gated_delta_rule_recurrent
from flashnext.ops.rms_norm import gated_rms_norm_reference


def gdn_decode_reference(mixed_qkv, z, b, a, conv_state, conv_weight, ssm_state, slots, A_log, dt_bias,
                         norm_weight, *, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
                         eps: float, activation: str) -> torch.Tensor:
    """The layer's own references on B one-token sequences: causal_conv1d_reference, gated_delta_rule_recurrent row by
    row (a Python loop over rows, no host sync), gated_rms_norm_reference."""
    rows = mixed_qkv.shape[0]
    key_dim = num_k_heads * head_k_dim
    qkv, conv_state[slots] = causal_conv1d_reference(mixed_qkv[:, None], conv_weight, conv_state[slots])
    q, k, v = torch.split(qkv[:, 0], [key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    states = ssm_state[slots]
    o = torch.empty(rows, num_v_heads, head_v_dim, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    for row in range(rows):
        o[row: row + 1], states[row] = gated_delta_rule_recurrent(
            q[row: row + 1].view(1, num_k_heads, head_k_dim), k[row: row + 1].view(1, num_k_heads, head_k_dim),
            v[row: row + 1].view(1, num_v_heads, head_v_dim), g[row: row + 1], beta[row: row + 1], states[row])
    ssm_state[slots] = states
    return gated_rms_norm_reference(o, z, norm_weight, eps, activation).reshape(rows, num_v_heads * head_v_dim)


def _use_triton(mixed_qkv: torch.Tensor, head_k_dim: int, head_v_dim: int) -> bool:
    if mixed_qkv.device.type != "cuda" or os.environ.get("FLASHNEXT_GDN_DECODE", "triton") == "reference":
        return False
    from flashnext.ops import gdn_decode_triton

    return gdn_decode_triton.supports(head_k_dim, head_v_dim)


def gdn_decode(mixed_qkv, z, b, a, conv_state, conv_weight, ssm_state, slots, A_log, dt_bias, norm_weight, *,
               num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int, eps: float,
               activation: str) -> torch.Tensor:
    """See the module docstring; the states at `slots` are updated in place."""
    fn = gdn_decode_reference
    if _use_triton(mixed_qkv, head_k_dim, head_v_dim):
        from flashnext.ops.gdn_decode_triton import gdn_decode_triton as fn
    return fn(mixed_qkv, z, b, a, conv_state, conv_weight, ssm_state, slots, A_log, dt_bias, norm_weight,
              num_k_heads=num_k_heads, head_k_dim=head_k_dim, num_v_heads=num_v_heads, head_v_dim=head_v_dim,
              eps=eps, activation=activation)
