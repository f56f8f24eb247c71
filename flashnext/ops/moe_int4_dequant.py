"""Prefill-sized routed experts through dequantised weights and a grouped bf16 GEMM (FLASHNEXT_MOE_PREFILL=dequant).

At prefill sizes the INT4 MoE kernels (ops/moe_int4_triton.py) were the largest item of a 10K-token Flash-Next
prefill on the H200: 358 of 1,235 ms, ~18% of bf16 peak (BENCHMARKS.md, session 3). Here each layer's stacked
experts are dequantised at once into a 16-bit scratch (Flash-Next, 512 experts: 3.4 GB gate|up + 1.7 GB down,
~2.4 ms to write and read back at the copy ceiling, freed after the layer; memory the KV plan does not reserve) and the (token, choice) rows, sorted by expert, go through
`torch._grouped_mm` (CUTLASS on Hopper) twice. Each weight is rounded once to x's dtype, and so are the GEMMs'
outputs (gate|up and down): two roundings more than the kernels, which keep gate|up and y in fp32 and round only
h = silu(gate)·up. Like the dense prefill matmuls (ops/int4_dequant_triton.py), the model keeps
INT4; only one layer's scratch exists at a time. Off by default until measured on the GPU.

Rows go back to (token, choice) order in x's dtype, then are weighted and added per token in fp32 after the k
choices, as the kernels do: deterministic, no atomics, no host sync.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashnext.ops.int4_dequant_triton import dequantize_triton
from flashnext.weights.int4_layout import Int4Weight

# tokens; a placeholder until measured: the scratch costs ~4 B per weight (written, read back) against the grouped
# kernels' 0.5 B per weight and expert block, so the break-even is many rows per expert, not a token count alone
DEQUANT_MIN_M = 256


def moe_int4_dequant(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: Int4Weight,
                     w_down: Int4Weight) -> torch.Tensor:
    """Same contract as ops.moe_int4.moe_int4_reference."""
    return moe_int4_dequant_pairs(x, topk_ids, topk_weights, w_gate_up, w_down).sum(1).to(x.dtype)


def moe_int4_dequant_pairs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                           w_gate_up: Int4Weight, w_down: Int4Weight) -> torch.Tensor:
    """The weighted terms [M, k, H] fp32 that moe_int4_dequant sums over k (ops.moe_int4.routed_pairs)."""
    m, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = w_gate_up.qweight.shape[0]
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    # each expert's last row + 1, without a host sync (bincount reads its length back)
    experts = torch.arange(num_experts, device=x.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    rows = x[order // top_k]                                                    # [M·k, H], by expert
    gate, up = torch._grouped_mm(rows, dequantize_triton(w_gate_up, x.dtype), offs=ends).chunk(2, dim=-1)
    h = (F.silu(gate.float()) * up.float()).to(x.dtype)
    y = torch._grouped_mm(h, dequantize_triton(w_down, x.dtype), offs=ends)
    by_choice = torch.empty_like(y)
    by_choice[order] = y                                                        # back to (token, choice) order
    return by_choice.view(m, top_k, hidden).float() * topk_weights[..., None].float()
