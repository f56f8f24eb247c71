"""One program per row: softmax over the experts in fp32, k rounds of argmax-and-mask, renormalise, store.
E ≤ 4096 experts fit one program's registers (512 in Flash-Next and Qwen3-Next). Reference: ops/router_topk.py.
`router_gemv_topk_triton` does the router's GEMV too (ops/linear_gemv_triton.py's tiles), the rows routed by
the GEMV's last program to finish: one launch instead of two for a decode step's routing."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.arrival import arrival_counters, arrive_last
from flashnext.ops.linear_gemv_triton import NUM_WARPS, gemv_rows, tiles
from flashnext.ops.pdl import launch_options, wait_for_inputs


@triton.jit
def topk_row(logits_ptr, weights_ptr, ids_ptr, row, E, stride_row, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
             NORMALIZE: tl.constexpr, CACHE: tl.constexpr):
    """Row `row`'s routing: softmax in fp32, TOP_K rounds of argmax-and-mask, renormalise, store in rank order.
    CACHE: the logits' load cache modifier ('.cg' when other programs of the same launch wrote them)."""
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    logits = tl.load(logits_ptr + row * stride_row + offs, mask=valid, other=float("-inf"),
                     cache_modifier=CACHE).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    probs = p / tl.sum(p, axis=0)
    remaining = tl.where(valid, probs, -1.0)
    picked = tl.zeros([BLOCK_E], dtype=tl.float32)    # the chosen probabilities, at their expert's place
    order = tl.full([BLOCK_E], TOP_K, dtype=tl.int32)  # rank of each chosen expert (TOP_K: not chosen)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(remaining, axis=0)
        hit = offs == best
        picked = tl.where(hit, remaining, picked)
        order = tl.where(hit, j, order)
        remaining = tl.where(hit, -1.0, remaining)
    total = tl.sum(picked, axis=0)
    chosen = order < TOP_K
    value = picked / total if NORMALIZE else picked
    slot = row * TOP_K + order
    tl.store(weights_ptr + slot, value.to(weights_ptr.dtype.element_ty), mask=chosen)
    tl.store(ids_ptr + slot, offs.to(tl.int64), mask=chosen)


@triton.jit
def _router_topk_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_row, TOP_K: tl.constexpr,
                        BLOCK_E: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    topk_row(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0), E, stride_row, TOP_K, BLOCK_E, NORMALIZE, "")


@triton.jit
def _router_gemv_topk_kernel(x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, counter_ptr, M, N, K, E, stride_x,
                             stride_w, stride_o, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOP_K: tl.constexpr,
                             BLOCK_E: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr):
    gemv_rows(x_ptr, w_ptr, logits_ptr, M, N, K, stride_x, stride_w, stride_o, BLOCK_N, BLOCK_K, PDL)
    if arrive_last(counter_ptr, tl.num_programs(0)):   # every program's logits are written: route the rows
        for m in range(M):
            topk_row(logits_ptr, weights_ptr, ids_ptr, m, E, stride_o, TOP_K, BLOCK_E, NORMALIZE, ".cg")


def router_topk_triton(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, experts = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty(rows, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(rows, top_k, dtype=torch.long, device=logits.device)
    if rows:
        _router_topk_kernel[(rows,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
                                     BLOCK_E=triton.next_power_of_2(experts), NORMALIZE=normalize, num_warps=4,
                                     **launch_options(logits.device))
    return weights, ids


def router_gemv_topk_triton(x: torch.Tensor, weight: torch.Tensor, num_experts: int, top_k: int,
                            normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] @ weight [N, K].T (the router's E rows first, then e.g. the shared-expert gate) → (logits [M, N] in
    x's dtype, routing weights [M, k], ids [M, k]) in one launch: the GEMV's last program to finish routes the rows
    (arrival counter, ops/arrival.py) — the top-k launch of router_topk_triton saved."""
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    logits = torch.empty(m, n, dtype=x.dtype, device=x.device)
    weights = torch.empty(m, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(m, top_k, dtype=torch.long, device=x.device)
    if m:
        block_n, block_k = tiles(n, k)
        _router_gemv_topk_kernel[(triton.cdiv(n, block_n),)](
            x, weight, logits, weights, ids, arrival_counters(x.device, 1), m, n, k, num_experts, x.stride(0),
            weight.stride(0), logits.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, TOP_K=top_k,
            BLOCK_E=triton.next_power_of_2(num_experts), NORMALIZE=normalize, num_warps=NUM_WARPS,
            **launch_options(x.device))
    return logits, weights, ids
