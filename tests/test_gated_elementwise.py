"""silu·mul, the shared-expert gated add and gated attention's output gate: the Triton kernels (TRITON_INTERPRET=1
on CPU) equal the torch expressions the model used, with strided views as the projections hand them over."""
import importlib.util

import pytest
import torch

from flashnext.ops.gated_elementwise import gated_add_reference, sigmoid_gate_reference, silu_mul_reference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("rows,n", [(1, 640), (3, 37), (5, 2100), (0, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_equal_references(rows, n, dtype):
    from flashnext.ops.gated_elementwise_triton import gated_add_triton, silu_mul_triton

    g = torch.Generator().manual_seed(rows + n)
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 2).to(dtype)
    gate, up = gate_up.split(n, dim=-1)                       # row stride 2n, like a stacked projection's output
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(silu_mul_triton(gate, up), silu_mul_reference(gate, up), **tol)
    stacked = torch.randn(rows, n + 1, generator=g).to(dtype)
    shared, logit = stacked.split([n, 1], dim=-1)
    routed = torch.randn(rows, n, generator=g).to(dtype)
    torch.testing.assert_close(gated_add_triton(routed, shared, logit), gated_add_reference(routed, shared, logit), **tol)



@pytest.mark.parametrize("rows,heads,d", [(1, 3, 64), (4, 2, 36), (0, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sigmoid_gate_equals_reference(rows, heads, d, dtype):
    from flashnext.ops.gated_elementwise_triton import sigmoid_gate_triton

    g = torch.Generator().manual_seed(rows * heads + d)
    q, gate = (torch.randn(rows, heads, 2 * d, generator=g) * 2).to(dtype).chunk(2, dim=-1)  # as attention's q|gate
    out = torch.randn(rows, heads, d, generator=g).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    got = sigmoid_gate_triton(out, gate)
    assert got.shape == (rows, heads * d)
    torch.testing.assert_close(got, sigmoid_gate_reference(out, gate), **tol)
