"""Prefill-sized routed experts through dequantised weights and a grouped bf16 GEMM (ops.moe_int4.prefill_path says
when: by default from ~195 rows an expert).

At prefill sizes the INT4 MoE kernels (ops/moe_int4_triton.py) run at ~145–200 TFLOP/s on the H200, the largest
item of a Flash-Next prefill (44% of a 10K prompt's GPU time, BENCHMARKS.md session 16). Here each layer's stacked
experts are dequantised at once into a 16-bit scratch (Flash-Next, 512 experts: 3.4 GB gate|up, then 1.7 GB down,
~1.5 ms a layer at the copy ceiling; `dequant_scratch_bytes`, which the engine's memory plan keeps free) and the
(token, choice) rows, sorted by expert, go through `torch._grouped_mm` (CUTLASS on Hopper) twice. Each weight is
rounded once to x's dtype, and so are the GEMMs' outputs (gate|up and down) and silu(gate)·up (rounded where torch
rounds it, ops/gated_elementwise.py): the kernels keep gate|up and y in fp32. Like the dense prefill matmuls
(ops/int4_dequant_triton.py), the model keeps INT4; only one weight's scratch exists at a time.

The expert-ordered rows are weighted and added per token in fp32 in one pass (ops/moe_combine.py), as the kernels
add theirs: deterministic (the expert order's atomics choose only the order within an expert, which no row's bits
depend on), no host sync.
"""
from __future__ import annotations

import torch

from flashnext.ops.expert_order import expert_order
from flashnext.ops.gated_elementwise import silu_mul
from flashnext.ops.int4_dequant_triton import dequantize_triton
from flashnext.ops.moe_combine import combine_choices
from flashnext.weights.int4_layout import Int4Weight


def moe_int4_dequant(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: Int4Weight,
                     w_down: Int4Weight) -> torch.Tensor:
    """Same contract as ops.moe_int4.moe_int4_reference."""
    m, top_k = topk_ids.shape
    num_experts = w_gate_up.qweight.shape[0]
    plan = expert_order(topk_ids, num_experts, None)   # the grouped GEMM takes each expert's run whole
    gate_up = torch._grouped_mm(x.index_select(0, plan.order // top_k), dequantize_triton(w_gate_up, x.dtype),
                                offs=plan.ends)
    gate, up = gate_up.chunk(2, dim=-1)
    rows = torch._grouped_mm(silu_mul(gate, up), dequantize_triton(w_down, x.dtype), offs=plan.ends)  # expert order
    return combine_choices(rows, plan.position.view(m, top_k), topk_weights, x.dtype)


def dequant_scratch_bytes(w_gate_up: Int4Weight, w_down: Int4Weight, dtype: torch.dtype) -> int:
    """The largest dequantised stack a layer holds at once (gate|up; down is half of it for Flash-Next)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(w.qweight.shape[0] * w.in_features * w.out_features for w in (w_gate_up, w_down)) * itemsize

