"""ops/expert_order.py in Triton: a counting sort of the pairs by expert, no host sync (capturable in a CUDA graph).

    1. _count_kernel (over the pairs): counts[e] += 1 for each pair's expert (atomics).
    2. _plan_kernel (one program, the experts as lanes): ends = cumsum(counts); the block table (with a block_m);
       counts becomes each expert's first sorted row, the cursor of step 3.
    3. _place_kernel (over the pairs): a pair takes the next row of its expert (an atomic on the cursor) and writes
       sorted_ids, order and position there — within an expert in the order the atomics come, which ExpertOrder
       leaves open.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.expert_order import ExpertOrder, table_size

BLOCK = 1024   # pairs a program of steps 1 and 3


@triton.jit(do_not_specialize=["n"])
def _count_kernel(ids_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    ids = tl.load(ids_ptr + offs, mask=ok, other=0)
    tl.atomic_add(counts_ptr + ids, 1, mask=ok)


@triton.jit(do_not_specialize=["table"])
def _plan_kernel(counts_ptr, ends_ptr, block_start_ptr, num_experts, table, HAS_TABLE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    counts = tl.load(counts_ptr + e, mask=e_ok, other=0)
    ends = tl.cumsum(counts, axis=0)
    starts = ends - counts
    tl.store(ends_ptr + e, ends, mask=e_ok)
    tl.store(counts_ptr + e, starts, mask=e_ok)          # the cursor _place_kernel advances
    if HAS_TABLE:
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        first_block = tl.cumsum(blocks, axis=0) - blocks
        for j in range(0, tl.max(blocks, axis=0)):      # block j of every expert that has one
            tl.store(block_start_ptr + first_block + j, starts + j * BLOCK_M, mask=e_ok & (j < blocks))
        used = tl.sum(blocks, axis=0)
        for t0 in range(0, table, BLOCK_T):              # the spare entries
            t = t0 + tl.arange(0, BLOCK_T)
            tl.store(block_start_ptr + t, tl.full((BLOCK_T,), -1, tl.int32), mask=(t >= used) & (t < table))


@triton.jit(do_not_specialize=["n"])
def _place_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, order_ptr, position_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    row = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
    tl.store(sorted_ids_ptr + row, ids, mask=ok)
    tl.store(order_ptr + row, offs, mask=ok)
    tl.store(position_ptr + offs, row, mask=ok)


def expert_order_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int | None) -> ExpertOrder:
    ids = topk_ids.reshape(-1)            # int32 or int64, read as they are (no conversion launch)
    n, device = ids.numel(), ids.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    table = 0 if block_m is None else table_size(n, num_experts, block_m)
    block_start = torch.empty(table, dtype=torch.int32, device=device)
    sorted_ids, order, position = (torch.empty(n, dtype=torch.int32, device=device) for _ in range(3))
    grid = (triton.cdiv(n, BLOCK),)
    if n:
        _count_kernel[grid](ids, counts, n, BLOCK=BLOCK)
    _plan_kernel[(1,)](counts, ends, block_start, num_experts, table, HAS_TABLE=block_m is not None,
                       BLOCK_M=block_m or 1, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_T=1024)
    if n:
        _place_kernel[grid](ids, counts, sorted_ids, order, position, n, BLOCK=BLOCK)
    return ExpertOrder(sorted_ids, order, position, ends, None if block_m is None else block_start)
