"""Causal depthwise conv with a carried tail: the Triton kernel (TRITON_INTERPRET=1 on CPU) equals the reference
(the layers' own math, held to transformers by the parity tests) for prompts shorter and longer than the tail,
dilated taps (PLE), an fp32 tail under 16-bit activations, and chunked calls equal one call."""
import importlib.util

import pytest
import torch

from flashnext.ops.causal_conv1d import causal_conv1d_reference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("length,channels,kernel,dilation", [(37, 20, 4, 1), (2, 33, 4, 1), (19, 16, 4, 3),
                                                             (1, 24, 4, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_reference(length, channels, kernel, dilation, dtype):
    from flashnext.ops.causal_conv1d_triton import causal_conv1d_triton

    g = torch.Generator().manual_seed(length * channels + dilation)
    span = (kernel - 1) * dilation
    x = torch.randn(length, channels, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(channels, kernel, generator=g) / 2).to(dtype).to(DEVICE)
    tail = torch.randn(span, channels, generator=g).to(DEVICE)          # the state pool's fp32 tail
    out, new_tail = causal_conv1d_triton(x, w, tail, dilation)
    want, want_tail = causal_conv1d_reference(x, w, tail, dilation)
    torch.testing.assert_close(out, want, rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-5)
    assert torch.equal(new_tail, want_tail)


def test_chunks_carry_the_tail():
    from flashnext.ops.causal_conv1d_triton import causal_conv1d_triton

    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 12, generator=g).to(DEVICE)
    w = torch.randn(12, 4, generator=g).to(DEVICE)
    whole, _ = causal_conv1d_triton(x, w, torch.zeros(3, 12, device=DEVICE))
    tail, parts = torch.zeros(3, 12, device=DEVICE), []
    for a, b in ((0, 2), (2, 31), (31, 50)):
        out, tail = causal_conv1d_triton(x[a:b], w, tail)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-6, atol=1e-6)
