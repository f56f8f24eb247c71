"""INT4 → 16-bit weights by the magic-number trick, two nibbles of a word a few instructions (the transposed-tile MoE
kernels' dequantisation, ops/moe_int4_swapped_triton.py), beside the plain conversion it must equal.

A 16-bit float whose exponent makes the mantissa's last place 1 — bf16 128.0 (0x4300, 7 mantissa bits), fp16 1024.0
(0x6400, 10) — with a nibble q OR-ed into its low bits is exactly MAGIC + q. A word shifted right by 4j holds nibble
j in bits 0–3 and nibble j + 4 in bits 16–19, so one lop3 makes the pair (MAGIC + q_j, MAGIC + q_{j+4}) as a packed
bf16x2 / f16x2; a packed fma subtracts MAGIC + zero (exact: both are small integers) and a second multiplies by the
scale — one rounding of the exact product, which is what the plain path's fp32 product (exact: 8 × 4 significant
bits) rounded to the dtype gives. Per word: 3 shifts, 4 lop3, 8 packed fmas for 8 weights, where the plain path
spends a shift, a mask, an integer subtract, an int → fp32 conversion (a quarter-rate instruction), a multiply and
half a packed conversion on each weight.

Taken (`magic_dequant`) for 16-bit activations whose scales have their dtype (GPTQ's fp16 scales beside bf16
activations would round), on a GPU; the interpreter runs no PTX, so the CPU tests run the plain path, and
`magic_pair_reference` checks the trick's constants in torch. FLASHNEXT_INT4_MAGIC=0 turns it off (A/B runs).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# dtype → (MAGIC: 1.0 in its last mantissa place, MAGIC's bits, the bits of 1.0, PTX's packed type)
_MAGIC = {torch.bfloat16: (128.0, 0x4300, 0x3F80, "bf16x2"), torch.float16: (1024.0, 0x6400, 0x3C00, "f16x2")}


def magic_dequant(x_dtype: torch.dtype, device: torch.device, *scales_dtypes: torch.dtype) -> bool:
    """Whether the kernels dequantise by the trick: 16-bit activations, every weight's scales of the same dtype, a
    CUDA device under the compiler (not the interpreter), FLASHNEXT_INT4_MAGIC not 0 (read at each call)."""
    return (x_dtype in _MAGIC and all(d == x_dtype for d in scales_dtypes) and device.type == "cuda"
            and os.environ.get("TRITON_INTERPRET", "0") != "1" and os.environ.get("FLASHNEXT_INT4_MAGIC", "1") != "0")


def _negative(magic_bits: int) -> int:
    """The bits of −MAGIC; plus a zero point z (< one mantissa's range) they are the bits of −(MAGIC + z)."""
    return (magic_bits | 0x8000) - 0x10000     # as an int16 (the reference's view; the kernel keeps the low half)


def magic_pair_reference(words: torch.Tensor, j: int, zero: torch.Tensor, scale: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The trick step by step in torch (int32 words [..], zero int [..], scale 16-bit [..]) → the weights of nibbles
    j and j + 4, in scale's dtype. torch rounds each 16-bit op once from an exact fp32 result, as the packed fma
    does."""
    dtype = scale.dtype
    magic, magic_bits, _, _ = _MAGIC[dtype]
    t = ((words >> (4 * j)) & 0x000F000F) | (magic_bits * 0x10001)
    lanes = torch.stack([t & 0xFFFF, (t >> 16) & 0xFFFF], dim=-1).to(torch.int16)   # low lane: nibble j
    values = lanes.view(dtype)                                                       # MAGIC + q, exactly
    offset = (_negative(magic_bits) + zero).to(torch.int16).view(dtype)[..., None]     # −(MAGIC + zero), as built
    weights = (values + offset) * scale[..., None]
    return weights[..., 0], weights[..., 1]


_BF16_NEGATIVE = tl.constexpr(_negative(_MAGIC[torch.bfloat16][1]) & 0xFFFF)
_FP16_NEGATIVE = tl.constexpr(_negative(_MAGIC[torch.float16][1]) & 0xFFFF)


@triton.jit
def magic_operands(zero, scale, dtype: tl.constexpr):
    """[BLOCK_N] zero points (int32) and scales (dtype) → the packed pairs the trick takes: −(MAGIC + zero) and the
    scale, each in both halves of an int32."""
    if dtype == tl.bfloat16:
        negative_magic = _BF16_NEGATIVE
    else:
        negative_magic = _FP16_NEGATIVE
    offset = negative_magic + zero                      # −(MAGIC + zero): its mantissa holds the zero point
    bits = scale.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return offset | (offset << 16), bits | (bits << 16)


# Per instance two elements of the tiles (pack=2): $2, $3 their words shifted, $4, $5 their −(MAGIC + zero) pairs, $6,
# $7 their scale pairs; $0 ← both elements' nibble j (low halves), $1 ← both elements' nibble j + 4 (high halves).
_MAGIC_PAIR_ASM = """{
    .reg .b32 t0, t1, mask, magic, one, nzero;
    mov.b32 mask, 0x000F000F;
    mov.b32 magic, MAGIC;
    mov.b32 one, ONE;
    mov.b32 nzero, 0x80008000;
    lop3.b32 t0, $2, mask, magic, 0xEA;
    lop3.b32 t1, $3, mask, magic, 0xEA;
    fma.rn.KIND t0, t0, one, $4;
    fma.rn.KIND t1, t1, one, $5;
    fma.rn.KIND t0, t0, $6, nzero;
    fma.rn.KIND t1, t1, $7, nzero;
    prmt.b32 $0, t0, t1, 0x5410;
    prmt.b32 $1, t0, t1, 0x7632;
}"""


def _pair_asm(dtype: torch.dtype) -> tl.constexpr:
    _, magic_bits, one_bits, kind = _MAGIC[dtype]
    return tl.constexpr(_MAGIC_PAIR_ASM.replace("MAGIC", f"{magic_bits * 0x10001:#010x}")
                        .replace("ONE", f"{one_bits * 0x10001:#010x}").replace("KIND", kind))


_BF16_ASM, _FP16_ASM = _pair_asm(torch.bfloat16), _pair_asm(torch.float16)


@triton.jit
def magic_pair(packed, j: tl.constexpr, offset_pair, scale_pair, dtype: tl.constexpr):
    """Nibbles j and j + 4 (j < 4) of int32 words [BLOCK_N, SUB] → two [BLOCK_N, SUB] weight tiles in dtype
    (offset_pair, scale_pair: magic_operands' [BLOCK_N], one a column). lop3's table 0xEA is (a & b) | c."""
    shifted = packed >> (4 * j)
    offsets = tl.broadcast_to(offset_pair[:, None], packed.shape)
    scales = tl.broadcast_to(scale_pair[:, None], packed.shape)
    if dtype == tl.bfloat16:
        low, high = tl.inline_asm_elementwise(_BF16_ASM, "=r,=r,r,r,r,r,r,r", [shifted, offsets, scales],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    else:
        low, high = tl.inline_asm_elementwise(_FP16_ASM, "=r,=r,r,r,r,r,r,r", [shifted, offsets, scales],
                                              dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    return low, high
