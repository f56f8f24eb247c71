"""The (token, choice) pairs of a MoE layer in expert order, and the blocks of rows a prefill kernel takes — the plan
every prefill-sized routed-expert path starts from (ops/moe_int4_triton.py, moe_int4_swapped_triton.py,
moe_int4_dequant.py).

    pairs p = token · k + j, expert topk_ids[token, j];  P pairs, E experts, blocks of block_m rows
    sorted_ids [P] int32   the pairs' experts, ascending
    order      [P] int32   the pair at each sorted row: topk_ids.flatten()[order] == sorted_ids
    position   [P] int32   the sorted row of each pair: order's inverse
    ends       [E] int32   one past each expert's last sorted row (the cumulative counts)
    block_start [P // block_m + min(E, P)] int32   each expert's run cut into blocks of block_m rows, the first row of
                           every block in expert order, then -1 for the spare entries (the bound needs no host sync);
                           None without a block_m (the dequant path's grouped GEMM takes the runs whole)

Within one expert the pairs' order is left open: each row of an expert's block is computed on its own (a row of the
products, the same weights), so any order gives the same bits. The reference takes the pairs' order (a stable
sort); the Triton kernels (ops/expert_order_triton.py) the order of their atomic counters — four launches where the
sort and the block arithmetic took ~25, each with its host time (~0.45 ms a layer of an eager prefill step on the
H200 under cProfile; but a Triton launch costs the host several torch launches' time, and the engine showed no gain
beyond its run-to-run spread: BENCHMARKS.md session 20).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertOrder:
    sorted_ids: torch.Tensor
    order: torch.Tensor
    position: torch.Tensor
    ends: torch.Tensor
    block_start: torch.Tensor | None


def table_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Entries of the block table: at most P // block_m full blocks plus one partial block an expert that has rows."""
    return num_pairs // block_m + min(num_experts, num_pairs)


def expert_order_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int | None) -> ExpertOrder:
    flat = topk_ids.reshape(-1)
    n, device = flat.numel(), flat.device
    sorted_ids, order = torch.sort(flat, stable=True)
    # counted without a host sync (bincount reads its length back), so FLASHNEXT_EXPERT_ORDER=reference times fairly
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).index_add_(0, flat.long(),
                                                                                   torch.ones_like(flat, dtype=torch.int64))
    ends = torch.cumsum(counts, 0)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=device))
    plan = [t.to(torch.int32) for t in (sorted_ids, order, position, ends)]
    if block_m is None:
        return ExpertOrder(*plan, None)
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    b = torch.arange(table_size(n, num_experts, block_m), device=device)
    expert = torch.searchsorted(block_end, b, right=True).clamp(max=num_experts - 1)
    start = (ends - counts)[expert] + (b - (block_end - blocks)[expert]) * block_m
    return ExpertOrder(*plan, torch.where(b < block_end[-1], start, -1).to(torch.int32))


def expert_order(topk_ids: torch.Tensor, num_experts: int, block_m: int | None) -> ExpertOrder:
    """CUDA tensors through the Triton kernels (the reference with FLASHNEXT_EXPERT_ORDER=reference, read each call:
    to bisect or to time both), others the reference."""
    if topk_ids.is_cuda and os.environ.get("FLASHNEXT_EXPERT_ORDER", "triton") != "reference":
        from flashnext.ops.expert_order_triton import expert_order_triton

        return expert_order_triton(topk_ids, num_experts, block_m)
    return expert_order_reference(topk_ids, num_experts, block_m)
