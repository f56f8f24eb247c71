"""Helpers the INT4 kernels share: the zero point and scale of one quantisation group for a tile's columns (the
decode kernels: w4a16_triton's GEMV, moe_int4_decode_triton), in the kernel layout of docs/int4.md, and the
tensors a launch passes for a weight's optional zeros and act-order permutation."""
import torch
import triton
import triton.language as tl

from flashnext.weights.int4_layout import Int4Weight


def optional_tensors(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """zeros and perm, or a dummy pointer never read (the kernels' HAS_ZEROS / HAS_PERM are constexprs)."""
    return (w.zeros if w.zeros is not None else w.scales), (w.perm if w.perm is not None else w.qweight)


@triton.jit
def group_zero_scale(zeros_ptr, scales_ptr, group, N, offs_n, n_ok, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr):
    """→ (zero, scale), fp32 [BLOCK_N]: group `group`'s zero point (8 for symmetric weights) and scale of columns
    offs_n; masked columns read 0."""
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + group * N + offs_n, mask=n_ok, other=0).to(tl.float32)
    else:
        zero = tl.full((BLOCK_N,), 8.0, tl.float32)
    scale = tl.load(scales_ptr + group * N + offs_n, mask=n_ok, other=0).to(tl.float32)
    return zero, scale
