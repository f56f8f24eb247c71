"""INT4 codes as 16-bit values without an int→float conversion, for the Triton kernels that dequantise into tl.dot.

A code q in 0..15 OR'd into the bits of 128 in bfloat16 (0x4300) reads as exactly 128 + q, into those of 1024 in
float16 (0x6400) as 1024 + q; subtracting the zero point made the same way leaves q − zero, exactly — the "magic
number" conversion of FasterTransformer's and Marlin's INT4 kernels. `(q - zero).to(dtype)` is an int→float
conversion per weight (cvt.rn.bf16.s32 in the sm_90 PTX; conversions run below the FP32 rate), and the grouped MoE kernels
(ops/moe_int4_triton.py) and the W4A16 GEMM (ops/w4a16_triton.py) convert every weight of every tile they
multiply: at small M per expert that conversion, not the tensor cores, may bound them (the grouped kernels ran at
0.9–1.2 TB/s at 16–128 tokens on the H200, session 14). Their `magic` configs (MoeConfig, LaunchConfig) use
this, off by default until measured: scripts/gpu_moe.py (MoE at 16–128 and 4,096 tokens) and
scripts/gpu_prefill_gemm.py (dense and MoE prefill tiles) time and check both forms. Other activation dtypes (fp32:
tests, the CPU path) take the conversion.

The interpreter (TRITON_INTERPRET=1) gets float16 right but not bfloat16 arithmetic on the reinterpreted values
(NaNs and denormals): there `magic_applies` turns bfloat16's off, the tests check float16 on the CPU, and the GPU
scripts check bfloat16 (the same bits as the conversion). Zero points must stay below 128 (bfloat16's mantissa
bits; the layouts store at most 16, auto_gptq's stored 15 + 1).
"""
import torch
import triton
import triton.language as tl


def magic_applies(magic: bool, x: torch.Tensor) -> bool:
    """The MAGIC constexpr of a launch for activations x: the config's choice, except bfloat16 off a GPU."""
    return magic and (x.is_cuda or x.dtype != torch.bfloat16)


@triton.jit
def _biased(v, dtype: tl.constexpr):
    """Codes v (int32, 0..15) → 128 + v as bfloat16, or 1024 + v as float16, by their bits."""
    if dtype == tl.bfloat16:
        return (v | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return (v | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def int4_values(q, zero, dtype: tl.constexpr, MAGIC: tl.constexpr):
    """q [K, N] int32 codes and zero [N] int32 → q − zero in `dtype` (exact): by the bits with MAGIC for a 16-bit
    float dtype, else by a conversion."""
    if MAGIC and (dtype == tl.bfloat16 or dtype == tl.float16):
        return _biased(q, dtype) - _biased(zero, dtype)[None, :]
    else:
        return (q - zero[None, :]).to(dtype)


@triton.jit
def int4_values_fp32(q, zero, dtype: tl.constexpr, MAGIC: tl.constexpr):
    """q − zero as fp32 (for a tile scaled before the dot): from the 16-bit values with MAGIC, else converted
    straight from the integers (one conversion, not two)."""
    if MAGIC:
        return int4_values(q, zero, dtype, MAGIC).to(tl.float32)
    else:
        return (q - zero[None, :]).to(tl.float32)
