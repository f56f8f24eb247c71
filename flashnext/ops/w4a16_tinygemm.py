"""PyTorch's INT4 matmul for few rows ("tinygemm": torch.ops.aten._weight_int4pack_mm, and its CPU twin) as the
decode path of the dense INT4 projections with bf16 activations.

Measured on the H200 at the Flash-Next decode shapes, L2-cold (scripts/gpu_tinygemm.py, BENCHMARKS.md): at one
row it takes 14.7 µs for the stacked GatedDeltaNet qkv|z (21 MB) where our Triton GEMV takes 21.2, 12.6 against
17.7 for attention's q|k|v and 7.6 against 10.5 for the out projection; at 2–4 rows 3–5× less. So a weight that
decode reads also gets tinygemm's layout once at load (`to_tinygemm`; the model keeps ours for prefill, whose
GEMM kernel it serves, and for fp32/fp16 activations, which tinygemm does not take).

tinygemm dequantises q in 0..15 as (q − 8) · scale + zero per group, with scale and zero in one bf16 tensor
[K/g, N, 2]. Ours is (q − z) · s (docs/int4.md), so zero = (8 − z) · s: 0 for symmetric weights (exact), a
bf16-rounded offset for asymmetric ones; a checkpoint's fp16 scales are rounded to bf16 too. It computes in bf16 where our kernels compute in fp32: results differ
from w4a16_linear_reference by ~5e-3 of the largest output (bf16 products), not only by summation order.
Act-order weights (a column permutation) are not supported and keep the Triton path; so do shapes with N not a
multiple of 16 (the CPU twin's rule; CUDA asks 8) or K not a multiple of 16 · INNER_K_TILES.
FLASHNEXT_W4A16_DECODE=triton keeps every projection on the Triton GEMV (and skips the extra layout: ~1.5 GB
for Flash-Next).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flashnext.ops.device import compute_capability
from flashnext.weights.int4 import unpack_int32
from flashnext.weights.int4_layout import SYMMETRIC_ZERO, Int4Weight

INNER_K_TILES = 8          # the H200 timing: 8 beat 4 slightly and 2 by ~30% at every shape
GROUP_SIZES = (32, 64, 128, 256)
MAX_ROWS = 8               # decode batches; more rows take the GEMM kernel (tinygemm is a GEMV-like kernel)


@dataclass
class TinygemmWeight:
    packed: torch.Tensor             # _convert_weight_to_int4pack's layout (CUDA) or its CPU twin's
    scales_and_zeros: torch.Tensor   # bf16 [K/g, N, 2]
    group_size: int


def enabled() -> bool:
    return os.environ.get("FLASHNEXT_W4A16_DECODE", "tinygemm") != "triton"


def supports(w: Int4Weight) -> bool:
    k, n = w.in_features, w.out_features
    return (w.perm is None and w.qweight.dim() == 2 and w.group_size in GROUP_SIZES and n % 16 == 0
            and k % (16 * INNER_K_TILES) == 0 and _device_has_it(w.qweight.device))


def _device_has_it(device: torch.device) -> bool:
    """tinygemm's CUDA kernel needs Ampere (compute capability 8.0) or later; its CPU twin runs anywhere."""
    return device.type == "cpu" or (device.type == "cuda" and compute_capability(device)[0] >= 8)


def codes(w: Int4Weight) -> torch.Tensor:
    """The 4-bit codes q [N, K] (int32, 0..15) of our [K/8, N] words."""
    return unpack_int32(w.qweight, 4, dim=0).t().contiguous()


def scales_and_zeros(w: Int4Weight) -> torch.Tensor:
    scales = w.scales.float()
    offset = torch.zeros_like(scales) if w.zeros is None else (SYMMETRIC_ZERO - w.zeros.float()) * scales
    return torch.stack([scales, offset], dim=-1).to(torch.bfloat16).contiguous()


def to_tinygemm(w: Int4Weight, inner_k_tiles: int = INNER_K_TILES) -> TinygemmWeight:
    assert supports(w) and w.in_features % (16 * inner_k_tiles) == 0, "see supports()"
    q = codes(w)
    if q.is_cuda:
        packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous(),
                                                            inner_k_tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)
    return TinygemmWeight(packed, scales_and_zeros(w), w.group_size)


def tinygemm_matmul(x: torch.Tensor, tw: TinygemmWeight) -> torch.Tensor:
    """x [M, K] bf16 → [M, N] bf16."""
    if x.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x.contiguous(), tw.packed, tw.group_size, tw.scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), tw.packed, tw.group_size, tw.scales_and_zeros)
