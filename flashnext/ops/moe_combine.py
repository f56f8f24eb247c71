"""A token's routed expert outputs, weighted and added: the last step of a MoE whose expert rows were computed in
expert order (ops/moe_int4_dequant.py).

    out[m] = sum_j weights[m, j] * rows[position[m, j]]      (fp32, j in order, rounded once to `dtype`)

rows [R, H] (16-bit or fp32, any row stride, last dim contiguous); position [M, k] int, the row of each (token,
choice); weights [M, k] → [M, H] in `dtype`. One pass over the rows instead of scattering them back into (token,
choice) order, materialising [M, k, H] fp32 and summing it (~4× the bytes, and an index_put that sorts).
`combine_choices` sends CUDA tensors to ops/moe_combine_triton.py.
"""
from __future__ import annotations

import torch


def combine_choices_reference(rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor,
                              dtype: torch.dtype) -> torch.Tensor:
    return (rows[position].float() * weights[..., None].float()).sum(1).to(dtype)


def combine_choices(rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    if rows.is_cuda:
        from flashnext.ops.moe_combine_triton import combine_choices_triton

        return combine_choices_triton(rows, position, weights, dtype)
    return combine_choices_reference(rows, position, weights, dtype)
