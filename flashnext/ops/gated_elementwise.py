"""Elementwise steps of the MoE block and of gated attention, each one kernel on the GPU instead of two or three
torch kernels:

    silu_mul(gate, up)                 = silu(gate) · up                      (the expert MLP's activation)
    gated_add(routed, shared, logit)   = routed + sigmoid(logit) · shared     (the shared expert joins the routed sum)
    sigmoid_gate(out, gate)            = out · sigmoid(gate), flattened heads (gated attention's output gate)

gate, up [N, I] (views allowed, last dim contiguous); routed, shared [N, H]; logit [N, 1]; out, gate [N, heads, D]
(gate usually a strided half of the q projection) → [N, heads·D]. The references are the model's torch
expressions and round where torch rounds (after each op in 16-bit); the dispatchers send CUDA tensors to
ops/gated_elementwise_triton.py. FLASHNEXT_ELEMENTWISE=reference forces the references.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gated_add_reference(routed: torch.Tensor, shared: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    return routed + torch.sigmoid(logit) * shared


def sigmoid_gate_reference(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return out.flatten(1) * torch.sigmoid(gate.flatten(1))


def _triton(*tensors: torch.Tensor, dim: int = 2) -> bool:
    return (tensors[0].is_cuda and tensors[0].dim() == dim and all(t.dtype == tensors[0].dtype for t in tensors)
            and os.environ.get("FLASHNEXT_ELEMENTWISE", "triton") != "reference")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if _triton(gate, up):
        from flashnext.ops.gated_elementwise_triton import silu_mul_triton

        return silu_mul_triton(gate, up)
    return silu_mul_reference(gate, up)


def gated_add(routed: torch.Tensor, shared: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    if _triton(routed, shared, logit):
        from flashnext.ops.gated_elementwise_triton import gated_add_triton

        return gated_add_triton(routed, shared, logit)
    return gated_add_reference(routed, shared, logit)


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    if (_triton(out, gate, dim=3) and gate.shape == out.shape and out.stride(-1) == 1 and gate.stride(-1) == 1):
        from flashnext.ops.gated_elementwise_triton import sigmoid_gate_triton

        return sigmoid_gate_triton(out, gate)
    return sigmoid_gate_reference(out, gate)
