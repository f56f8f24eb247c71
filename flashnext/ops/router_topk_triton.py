"""One program per row: softmax over the experts in fp32, k rounds of argmax-and-mask, renormalise, store.
E ≤ 4096 experts fit one program's registers (512 in Flash-Next and Qwen3-Next). Reference: ops/router_topk.py.

Each round is a reduction across the program's warps (3.9 µs a call at 4 warps on the H200, 48 a Flash-Next step,
session 13). 1 warp, whose rounds need no shared-memory step, was measured slower: 4.604 ms a Flash-Next INT4 decode
step against 4.504 at 4 warps (scripts/gpu_decode.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.ops.pdl import launch_options, wait_for_inputs


@triton.jit
def _router_topk_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_row, TOP_K: tl.constexpr,
                        BLOCK_E: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    logits = tl.load(logits_ptr + row * stride_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
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
