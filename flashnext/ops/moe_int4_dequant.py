"""Prefill-sized routed experts through dequantised weights and a grouped bf16 GEMM (FLASHNEXT_MOE_PREFILL=dequant).

At prefill sizes the INT4 MoE kernels (ops/moe_int4_triton.py) were the largest item of a 10K-token Flash-Next
prefill on the H200: 358 of 1,235 ms, ~18% of bf16 peak (BENCHMARKS.md, session 3). Here each layer's stacked
experts are dequantised at once into a 16-bit scratch (Flash-Next: 1.7 GB gate|up + 0.8 GB down, ~1 ms to
write at the copy ceiling, freed after the layer) and the (token, choice) rows, sorted by expert, go through
`torch._grouped_mm` (CUTLASS on Hopper) twice: the same arithmetic as the reference but with each weight
rounded once to x's dtype and h = silu(gate)·up rounded to it as the kernels do. Like the dense
FLASHNEXT_W4A16_PREFILL=dequant (ops/int4_dequant_triton.py), the model keeps INT4; only one layer's scratch
exists at a time. Off by default until measured on the GPU.

Rows are added back per token in fp32 after the k choices (out = y.view(M, k, H).sum(1)), as the kernels do:
deterministic, no atomics.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from flashnext.ops.int4_dequant_triton import dequantize_triton
from flashnext.weights.int4_layout import Int4Weight

DEQUANT_MIN_M = 256   # tokens; below this the kernels' weight traffic is less than the scratch's


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [R, K] sorted by group, weights [G, K, N], ends [G] int32 (cumulative row counts) → [R, N]:
    row r of group g times weights[g]. torch._grouped_mm where the device has it, else one matmul per group."""
    if rows.is_cuda or _cpu_grouped_mm():
        return torch._grouped_mm(rows, weights, offs=ends)
    out = rows.new_empty(rows.shape[0], weights.shape[-1])
    start = 0
    for g, end in enumerate(ends.tolist()):
        out[start:end] = rows[start:end] @ weights[g]
        start = end
    return out


@functools.cache
def _cpu_grouped_mm() -> bool:
    try:
        torch._grouped_mm(torch.zeros(1, 8), torch.zeros(1, 8, 8), offs=torch.ones(1, dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def moe_int4_dequant(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: Int4Weight,
                     w_down: Int4Weight) -> torch.Tensor:
    """Same contract as ops.moe_int4.moe_int4_reference."""
    m, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = w_gate_up.qweight.shape[0]
    flat = topk_ids.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    ends = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    rows = x[order // top_k].contiguous()                                       # [M·k, H], by expert
    gate, up = grouped_mm(rows, dequantize_triton(w_gate_up, x.dtype), ends).chunk(2, dim=-1)
    h = (F.silu(gate.float()) * up.float()).to(x.dtype)
    y = grouped_mm(h, dequantize_triton(w_down, x.dtype), ends).float()
    y *= topk_weights.reshape(-1)[order, None].float()
    out = torch.empty(m * top_k, hidden, dtype=torch.float32, device=x.device)
    out[order] = y                                                              # back to (token, choice) order
    return out.view(m, top_k, hidden).sum(1).to(x.dtype)
