"""W4A16 linear: y = x @ W.T with W in the INT4 kernel layout (docs/int4.md), activations in 16/32 bit.

`w4a16_linear_reference` is the specification: dequantise to fp32, matmul in fp32, round once to x's dtype.
`w4a16_linear` dispatches: bf16 activations of up to 8 rows with the weight's tinygemm form (models/decode_forms.py
attaches it at load) → PyTorch's INT4 matmul (ops/w4a16_tinygemm.py, CUDA or CPU); other CUDA tensors → the
Triton kernels (ops/w4a16_triton.py: up to GEMV_MAX_M = 8 rows the split-K GEMV kernel, more rows the GEMM
kernel); anything else → the reference. FLASHNEXT_W4A16=reference forces the reference (to bisect a wrong
answer on the GPU).
"""
from __future__ import annotations

import os

import torch

from flashnext.ops import w4a16_tinygemm
from flashnext.weights.int4_layout import Int4Weight, dequantize


def w4a16_linear_reference(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [..., K] → [..., N] in x's dtype."""
    return (x.float() @ dequantize(w).t()).to(x.dtype)


def _reference_forced() -> bool:
    return os.environ.get("FLASHNEXT_W4A16", "triton") == "reference"


def _use_triton(x: torch.Tensor, w: Int4Weight) -> bool:
    if x.device.type != "cuda" or _reference_forced():
        return False
    from flashnext.ops import w4a16_triton

    return w4a16_triton.supports(w)


def w4a16_linear(x: torch.Tensor, w: Int4Weight,
                 decode_form: w4a16_tinygemm.TinygemmWeight | None = None) -> torch.Tensor:
    """x [..., K] → [..., N] in x's dtype. `decode_form`: the weight in tinygemm's layout, if it has one."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if (decode_form is not None and x.dtype == torch.bfloat16 and 0 < rows.shape[0] <= w4a16_tinygemm.MAX_ROWS
            and not _reference_forced() and w4a16_tinygemm.enabled()):   # (read here too: a graph capture's A/B)
        return w4a16_tinygemm.tinygemm_matmul(rows, decode_form).reshape(*lead, w.out_features)
    if not _use_triton(x, w):
        return w4a16_linear_reference(x, w)
    from flashnext.ops.w4a16_triton import w4a16_matmul

    return w4a16_matmul(rows, w).reshape(*lead, w.out_features)
