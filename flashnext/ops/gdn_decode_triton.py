"""Triton GatedDeltaNet decode step (ops/gdn_decode.py has the shapes and the reference): two launches.

1. `_conv_kernel`, grid (rows, channel blocks): the causal conv of the new token over its carried tail, silu,
   rounded to x's dtype into a [B, C] scratch buffer; shifts the tail in place. Each channel of a row has one
   owner, so the tail is read and written exactly once. The conv is a separate launch because the r value
   heads of a key head all need its q and k channels: in one launch a program could read a tail that another
   had already shifted.
2. `_delta_rule_kernel`, grid (rows, value heads): l2norm of q and k, β and the decay, the delta-rule update of
   the head's whole fp32 state [Dk, Dv] held in registers (read once, written once, rows along Dv contiguous
   so loads and stores are 16-byte vectors of full cache lines), o = Sᵀq, and the gated RMSNorm, which needs
   the whole Dv row of the head — the reason a program owns a head rather than a Dv tile.
The state is the traffic (Flash-Next: 48 heads × 64 KiB per sequence and layer, read and written); the rest
is a few KiB per row. No host sync and no data-dependent allocation: the step can be captured in a CUDA graph.

A fused form (the conv and the layer's b|a projection inside the delta-rule launch, sessions 13/14) was measured
slower on the H200: 4.709 ms a Flash-Next INT4 decode step against 4.504 (scripts/gpu_decode.py), and alone
9.5 / 16.9 / 27.5 µs at B = 1 / 4 / 8 against 5.8 / 9.3 / 15.5 for the delta-rule kernel, more than the conv kernel
(~2.1 µs) and the b|a GEMV (~2.3 µs) it saved (scripts/gpu_gdn_decode.py). So the conv stays its own launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.pdl import launch_options, wait_for_inputs

CONV_BLOCK = 256
# At least one lane per channel: a channel replicated on two threads could be shifted by one before the other
# reads it.
CONV_WARPS = 2
MAX_STATE_ELEMENTS = 128 * 128   # one head's state lives in the registers of one program


@triton.jit
def _conv_kernel(x_ptr, w_ptr, tail_ptr, slots_ptr, y_ptr, C, stride_x, stride_wc, stride_wt, stride_slot, stride_t,
                 WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    slot = tl.load(slots_ptr + row)
    tail = tail_ptr + slot * stride_slot + cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    w_last = tl.load(w_ptr + cols * stride_wc + (WIDTH - 1) * stride_wt, mask=mask, other=0.0)
    acc = x.to(tl.float32) * w_last.to(tl.float32)
    for t in tl.static_range(WIDTH - 1):
        prev = tl.load(tail + t * stride_t, mask=mask, other=0.0)
        w = tl.load(w_ptr + cols * stride_wc + t * stride_wt, mask=mask, other=0.0).to(tl.float32)
        acc += prev.to(x.dtype).to(tl.float32) * w
        if t > 0:  # row t - 1 was read by this same thread in the previous step
            tl.store(tail + (t - 1) * stride_t, prev, mask=mask)
    tl.store(tail + (WIDTH - 2) * stride_t, x.to(tail_ptr.dtype.element_ty), mask=mask)
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + row * C + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _delta_rule_kernel(qkv_ptr, z_ptr, b_ptr, a_ptr, state_ptr, slots_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
                       out_ptr, stride_qkv, stride_zb, stride_zh, stride_bb, stride_bh, stride_ab, stride_ah,
                       stride_slot, stride_sh, stride_sk, q_scale, eps,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, SIGMOID_GATE: tl.constexpr, ROUND_WEIGHTED: tl.constexpr,
                       PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // (HV // HK)
    dtype = out_ptr.dtype.element_ty
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    mask_k = offs_k < DK
    mask_v = offs_v < DV

    qkv = qkv_ptr + row * stride_qkv
    q = tl.load(qkv + key_head * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(qkv + (HK + key_head) * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(qkv + 2 * HK * DK + head * DV + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    # β is rounded to x's dtype: the layer takes sigmoid(b) before the recurrence casts to fp32.
    beta = tl.sigmoid(tl.load(b_ptr + row * stride_bb + head * stride_bh).to(tl.float32)).to(dtype).to(tl.float32)
    a = tl.load(a_ptr + row * stride_ab + head * stride_ah).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus

    slot = tl.load(slots_ptr + row)
    s_ptrs = state_ptr + slot * stride_slot + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    s_mask = mask_k[:, None] & mask_v[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0) * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(s_ptrs, s, mask=s_mask)
    o = tl.sum(s * q[:, None], axis=0).to(dtype).to(tl.float32)

    # GatedRMSNorm with the layer's rounding points (models/layers/norms.py).
    h = (o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)).to(dtype).to(tl.float32)
    h = tl.load(norm_w_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32) * h
    if ROUND_WEIGHTED:
        h = h.to(dtype).to(tl.float32)
    z = tl.load(z_ptr + row * stride_zb + head * stride_zh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    if SIGMOID_GATE:
        gate = tl.sigmoid(z)
    else:
        gate = z * tl.sigmoid(z)
    tl.store(out_ptr + row * HV * DV + head * DV + offs_v, (h * gate).to(dtype), mask=mask_v)


def supports(head_k_dim: int, head_v_dim: int) -> bool:
    return triton.next_power_of_2(head_k_dim) * triton.next_power_of_2(head_v_dim) <= MAX_STATE_ELEMENTS


def default_num_warps(head_k_dim: int, head_v_dim: int) -> int:
    # Measured on the H200 (scripts/gpu_gdn_decode.py, 128 x 128 heads, B = 1…8): 4 warps beat 8 and 16 at every
    # batch size (6.9 vs 8.4 µs at B = 1) even though 128 x 128 fp32 is then 128 registers a thread for the state.
    return 4


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gdn_decode_triton(mixed_qkv, z, b, a, conv_state, conv_weight, ssm_state, slots, A_log, dt_bias, norm_weight, *,
                      num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int, eps: float,
                      activation: str, num_warps: int | None = None) -> torch.Tensor:
    """Same contract as gdn_decode_reference. The states are written in place, so their innermost dimension
    must be contiguous (as StatePool allocates them); the inputs may have any strides."""
    rows, channels = mixed_qkv.shape
    width = conv_weight.shape[1]
    key_dim = num_k_heads * head_k_dim
    assert channels == 2 * key_dim + num_v_heads * head_v_dim and conv_state.shape[1:] == (width - 1, channels)
    assert ssm_state.shape[1:] == (num_v_heads, head_k_dim, head_v_dim) and ssm_state.dtype == torch.float32
    assert conv_state.stride(2) == 1 and ssm_state.stride(3) == 1, "states are updated in place: last dim contiguous"
    assert num_v_heads % num_k_heads == 0 and width >= 2 and supports(head_k_dim, head_v_dim)
    assert activation in ("silu", "sigmoid"), activation
    dtype = mixed_qkv.dtype
    out = torch.empty(rows, num_v_heads * head_v_dim, dtype=dtype, device=mixed_qkv.device)
    if rows == 0:
        return out
    mixed_qkv, z, conv_weight = _last_dim_unit(mixed_qkv), _last_dim_unit(z), _last_dim_unit(conv_weight)
    qkv = torch.empty(rows, channels, dtype=dtype, device=mixed_qkv.device)
    _conv_kernel[(rows, triton.cdiv(channels, CONV_BLOCK))](
        mixed_qkv, conv_weight, conv_state, slots, qkv, channels, mixed_qkv.stride(0), conv_weight.stride(0),
        conv_weight.stride(1), conv_state.stride(0), conv_state.stride(1),
        WIDTH=width, BLOCK_C=CONV_BLOCK, num_warps=CONV_WARPS, **launch_options(qkv.device))
    _delta_rule_kernel[(rows, num_v_heads)](
        qkv, z, b, a, ssm_state, slots, A_log, dt_bias, norm_weight, out,
        qkv.stride(0), z.stride(0), z.stride(1), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), head_k_dim ** -0.5, eps,
        HK=num_k_heads, HV=num_v_heads, DK=head_k_dim, DV=head_v_dim,
        BK=triton.next_power_of_2(head_k_dim), BV=triton.next_power_of_2(head_v_dim),
        SIGMOID_GATE=activation == "sigmoid", ROUND_WEIGHTED=norm_weight.dtype == dtype,
        num_warps=num_warps or default_num_warps(head_k_dim, head_v_dim), **launch_options(qkv.device))
    return out
