"""Prefill-sized routed experts through dequantised weights and a grouped bf16 GEMM (FLASHNEXT_MOE_PREFILL=dequant).

At prefill sizes the INT4 MoE kernels (ops/moe_int4_triton.py) were the largest item of a 10K-token Flash-Next
prefill on the H200: 358 of 1,235 ms, ~18% of bf16 peak (BENCHMARKS.md, session 3). Here each layer's stacked
experts are dequantised at once into a 16-bit scratch (Flash-Next: 1.7 GB gate|up + 0.8 GB down, ~1 ms to
write at the copy ceiling, freed after the layer) and the (token, choice) rows, sorted by expert, go through
`torch._grouped_mm` (CUTLASS on Hopper) twice. Each weight is rounded once to x's dtype, and so are the GEMMs'
outputs (gate|up and down): two roundings more than the kernels, which keep gate|up and y in fp32 and round only
h = silu(gate)·up. Like the dense FLASHNEXT_W4A16_PREFILL=dequant (ops/int4_dequant_triton.py), the model keeps
INT4; only one layer's scratch exists at a time. Off by default until measured on the GPU.

Rows are added back per token in fp32 after the k choices (out = y.view(M, k, H).sum(1)), as the kernels do:
deterministic, no atomics, no host sync.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashnext.ops.int4_dequant_triton import dequantize_triton
from flashnext.weights.int4_layout import Int4Weight

DEQUANT_MIN_M = 256   # tokens; below this the kernels' weight traffic is less than the scratch's


def moe_int4_dequant(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: Int4Weight,
                     w_down: Int4Weight) -> torch.Tensor:
    """Same contract as ops.moe_int4.moe_int4_reference."""
    m, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = w_gate_up.qweight.shape[0]
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    # each expert's last row + 1, without a host sync (bincount reads its length back)
    experts = torch.arange(num_experts, device=x.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    rows = x[order // top_k].contiguous()                                       # [M·k, H], by expert
    gate, up = torch._grouped_mm(rows, dequantize_triton(w_gate_up, x.dtype), offs=ends).chunk(2, dim=-1)
    h = (F.silu(gate.float()) * up.float()).to(x.dtype)
    y = torch._grouped_mm(h, dequantize_triton(w_down, x.dtype), offs=ends).float()
    y *= topk_weights.reshape(-1)[order, None].float()
    out = torch.empty(m * top_k, hidden, dtype=torch.float32, device=x.device)
    out[order] = y                                                              # back to (token, choice) order
    return out.view(m, top_k, hidden).sum(1).to(x.dtype)
