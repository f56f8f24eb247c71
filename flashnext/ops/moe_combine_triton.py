"""ops/moe_combine.py on the GPU: a program per (token, BLOCK_H columns) reads its k rows and adds them weighted, in
choice order, in fp32 — the same sum as the reference's up to its summation order."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 1024


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(rows_ptr, position_ptr, weights_ptr, out_ptr, stride_row, M, H, TOP_K: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(position_ptr + token * TOP_K + j).to(tl.int64)
        weight = tl.load(weights_ptr + token * TOP_K + j).to(tl.float32)
        acc += weight * tl.load(rows_ptr + row * stride_row + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine_choices_triton(rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
    m, top_k = position.shape
    hidden = rows.shape[1]
    assert rows.stride(-1) == 1 and weights.shape == position.shape
    out = torch.empty(m, hidden, dtype=dtype, device=rows.device)
    if m:
        _combine_kernel[(m, triton.cdiv(hidden, BLOCK_H))](
            rows, position.contiguous(), weights.contiguous(), out, rows.stride(0), m, hidden, TOP_K=top_k,
            BLOCK_H=BLOCK_H, num_warps=4)
    return out
