"""Helpers the INT4 kernels share: the zero point and scale of one quantisation group for a tile's columns (the
decode kernels: w4a16_triton's GEMV, moe_int4_decode_triton), in the kernel layout of docs/int4.md, the
tensors a launch passes for a weight's optional zeros and act-order permutation, and the decode kernels' nibbles
read as denormals (`denormal_bits`).

Denormal nibbles: nibble j of a word, masked in place and read as an fp32, is the denormal q * 16**j * 2**-149
exactly (denormals are kept: Triton emits fma.rn.f32, no ftz). Multiplying it by x * X_SCALE / 16**j gives
x * q * PRODUCT_UNIT for every j — one and + one fma a weight, no int -> float conversion —; the zero point comes
off as zero * PRODUCT_UNIT times the sum of a word's 8 activations, and UNSCALE goes back with the group scale.
The products are exact in fp32; scaled x stays finite for |x| < 2**32."""
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


X_SCALE = tl.constexpr(2.0 ** 96)
PRODUCT_UNIT = tl.constexpr(2.0 ** -53)
UNSCALE = tl.constexpr(2.0 ** 53)


@triton.jit
def denormal_bits(word, mask: tl.constexpr):
    """word & mask read as an fp32: for a nibble mask 0xF * 16**j (j <= 4), exactly q * 16**j * 2**-149."""
    return (word & mask).to(tl.float32, bitcast=True)
