"""Routed experts with INT4 weights: a readable torch reference and the dispatch to the Triton kernels.

Shapes: x [M, H]; topk_ids [M, k] (int); topk_weights [M, k]; w_gate_up a stacked Int4Weight of the
[E, 2I, H] gate|up weights (gate rows first, as `Experts.gate_up_proj`); w_down a stacked Int4Weight of
the [E, H, I] down weights. Returns [M, H] in x's dtype:
    out[m] = sum_j topk_weights[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])),  e = topk_ids[m, j]
The kernel layout (qweight int32 [E, K/8, N], scales [E, K/g, N], zeros uint8 [E, K/g, N] or None) is
docs/int4.md's; `flashnext.weights.int4_layout` owns it.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from flashnext.weights.int4_layout import Int4Weight, dequantize

# FLASHNEXT_MOE_INT4: "auto" (default: decode kernels up to DECODE_MAX_M tokens, grouped kernels above),
# "grouped" (the grouped kernels at every M), "reference" (the torch reference on CUDA too; debugging).
_BACKEND = os.environ.get("FLASHNEXT_MOE_INT4", "auto")
# FLASHNEXT_MOE_PREFILL=dequant: from DEQUANT_MIN_M tokens, dequantised experts and torch's grouped GEMM instead of
# the grouped kernels (ops/moe_int4_dequant.py; off until measured on the GPU).
_PREFILL = os.environ.get("FLASHNEXT_MOE_PREFILL", "triton")
DECODE_MAX_M = 8  # the decode kernels re-read an expert per token that chose it: fine up to a few tokens


def _expert(w: Int4Weight, e: int) -> Int4Weight:
    pick = (lambda t: None if t is None else t[e])
    return Int4Weight(w.qweight[e], w.scales[e], pick(w.zeros), pick(w.perm), w.group_size)


def moe_int4_reference(x, topk_ids, topk_weights, w_gate_up: Int4Weight, w_down: Int4Weight) -> torch.Tensor:
    """Dequantise each chosen expert once, run its tokens through it in fp32, add them up in fp32."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == e)
        gate, up = F.linear(xf[token], dequantize(_expert(w_gate_up, e))).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, dequantize(_expert(w_down, e)))
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out.to(x.dtype)


def moe_int4(x, topk_ids, topk_weights, w_gate_up: Int4Weight, w_down: Int4Weight) -> torch.Tensor:
    """CUDA: M <= DECODE_MAX_M -> the decode GEMV kernels (moe_int4_decode_triton), larger M -> the grouped
    kernels (moe_int4_triton), or with FLASHNEXT_MOE_PREFILL=dequant from DEQUANT_MIN_M on the grouped GEMM over
    dequantised experts (moe_int4_dequant); elsewhere the reference."""
    if x.is_cuda and _BACKEND != "reference":
        if x.shape[0] <= DECODE_MAX_M and _BACKEND != "grouped":
            from flashnext.ops.moe_int4_decode_triton import moe_int4_decode

            return moe_int4_decode(x, topk_ids, topk_weights, w_gate_up, w_down)
        if _PREFILL == "dequant" and _BACKEND == "auto":
            from flashnext.ops.moe_int4_dequant import DEQUANT_MIN_M, moe_int4_dequant

            if x.shape[0] >= DEQUANT_MIN_M:
                return moe_int4_dequant(x, topk_ids, topk_weights, w_gate_up, w_down)
        from flashnext.ops.moe_int4_triton import moe_int4_triton

        return moe_int4_triton(x, topk_ids, topk_weights, w_gate_up, w_down)
    return moe_int4_reference(x, topk_ids, topk_weights, w_gate_up, w_down)
