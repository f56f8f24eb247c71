"""GatedDeltaNet decode step: one new token for each of B sequences, from the projections to the gated norm.

Shapes (B rows, S state slots, C = 2·Hk·Dk + Hv·Dv conv channels):
    mixed_qkv [B, C] as [all q | all k | all v]; z [B, Hv, Dv]; b, a [B, Hv]   (x dtype)
    conv_state [S, K-1, C] (x dtype), ssm_state [S, Hv, Dk, Dv] fp32: read and updated in place at `slots` [B]
    conv_weight [C, K], A_log [Hv], dt_bias [Hv], norm_weight [Dv]
    → out [B, Hv·Dv] in x dtype (the input of out_proj)
It is GatedDeltaNet.forward for B one-token segments: causal conv with the carried tail (silu), l2-normalised
q and k (q scaled by Dk^-½), the gated delta rule (ops/gated_delta_rule.py) and GatedRMSNorm(o, z).

`gdn_decode_reference` is the specification and rounds where the layer rounds: the conv output and o to x's
dtype, β = sigmoid(b) in x's dtype, and the norm's `weight * h.to(dtype)`. `gdn_decode` dispatches: CUDA
tensors → the Triton kernels (ops/gdn_decode_triton.py), anything else → the reference.
FLASHNEXT_GDN_DECODE=reference forces the reference (to bisect a wrong answer on the GPU).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from flashnext.ops.gated_delta_rule import l2norm


def gdn_decode_reference(mixed_qkv, z, b, a, conv_state, conv_weight, ssm_state, slots, A_log, dt_bias,
                         norm_weight, *, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
                         eps: float, activation: str) -> torch.Tensor:
    dtype = mixed_qkv.dtype
    rows = mixed_qkv.shape[0]
    key_dim = num_k_heads * head_k_dim

    # Causal conv of one token: the tail and the new input are the whole receptive field.
    full = torch.cat([conv_state[slots].to(dtype), mixed_qkv[:, None]], dim=1)          # [B, K, C]
    qkv = F.conv1d(full.transpose(1, 2).to(conv_weight.dtype), conv_weight.unsqueeze(1), groups=full.shape[2])
    qkv = F.silu(qkv[..., 0]).to(dtype)                                                 # [B, C]
    conv_state[slots] = full[:, 1:].to(conv_state.dtype)

    q, k, v = torch.split(qkv.float(), [key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
    groups = num_v_heads // num_k_heads
    q = q.reshape(rows, num_k_heads, head_k_dim).repeat_interleave(groups, dim=1)       # [B, Hv, Dk]
    k = k.reshape(rows, num_k_heads, head_k_dim).repeat_interleave(groups, dim=1)
    v = v.reshape(rows, num_v_heads, head_v_dim)
    q = l2norm(q) * head_k_dim ** -0.5
    k = l2norm(k)
    beta = b.sigmoid().float()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)

    s = ssm_state[slots].float() * g.exp()[..., None, None]                              # [B, Hv, Dk, Dv]
    delta = (v - (s * k[..., None]).sum(dim=-2)) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    o = (s * q[..., None]).sum(dim=-2).to(dtype)                                         # [B, Hv, Dv]
    ssm_state[slots] = s

    # GatedRMSNorm, step for step (models/layers/norms.py).
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = norm_weight * h.to(dtype)
    gate = z.float()
    gate = F.silu(gate) if activation == "silu" else torch.sigmoid(gate)
    return (h * gate).to(dtype).reshape(rows, num_v_heads * head_v_dim)


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
