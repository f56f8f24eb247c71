"""Norm + partial RoPE: the reference is the modules' own math, and the Triton kernel (TRITON_INTERPRET=1 on CPU)
equals it, with strided views as the attention layer passes them."""
import importlib.util

import pytest
import torch

from flashnext.models.layers.rope import RotaryEmbedding
from flashnext.ops.rope import apply_rotary
from flashnext.ops.norm_rope import norm_rope_reference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _case(rows, heads, dim, rot, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, heads, 2 * dim, generator=g).to(dtype)
    x = wide[..., :dim]                                             # like q out of q_proj's [query | gate]
    weight = (torch.randn(dim, generator=g) * 0.2).to(dtype)
    cos, sin = RotaryEmbedding(rot, 10000.0)(torch.arange(rows) * 7 + 3, dtype)
    return x, weight, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_module_math(dtype):
    """The norm half against transformers' own q/k norm (ours delegates to this op, so it would prove nothing)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

    x, weight, cos, sin = _case(5, 3, 32, 8, dtype)
    norm = Qwen4ExpTextRMSNorm(32, eps=1e-6).to(dtype)
    norm.weight.data = weight.clone()
    assert torch.equal(norm_rope_reference(x, weight, 1e-6, cos, sin), apply_rotary(norm(x), cos, sin))


@pytest.mark.parametrize("rows,heads,dim,rot", [(1, 4, 64, 16), (3, 2, 256, 64), (5, 1, 128, 32), (2, 3, 48, 48),
                                                (0, 2, 32, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_reference(rows, heads, dim, rot, dtype):
    from flashnext.ops.norm_rope_triton import norm_rope_triton

    x, weight, cos, sin = _case(rows, heads, dim, rot, dtype, seed=rows + dim)
    got = norm_rope_triton(x, weight, 1e-6, cos, sin)
    want = norm_rope_reference(x, weight, 1e-6, cos, sin)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-5)
