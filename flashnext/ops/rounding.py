"""A Triton helper the fused kernels share: round an fp32 value to a storage dtype and back to fp32, at the points
where their torch references round (a 16-bit tensor after each op), so bf16 results differ from the reference
only by summation order."""
import triton
import triton.language as tl


@triton.jit
def round_to_dtype(v, dtype: tl.constexpr):
    return v.to(dtype).to(tl.float32)
