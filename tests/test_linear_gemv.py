"""The Triton GEMV of small 16-bit decode projections (CPU: TRITON_INTERPRET=1, fp32) against F.linear at odd
sizes (N not a multiple of the row tile, K not a power of two), and the dispatch that keeps everything else on
F.linear."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from flashnext.ops.decode_linear import decode_linear

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("m,n,k", [(1, 13, 100), (3, 97, 640), (8, 5, 33)])
def test_gemv_equals_linear(m, n, k):
    from flashnext.ops.linear_gemv_triton import linear_gemv

    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, 2 * k, generator=g).to(DEVICE)[:, ::2]   # a strided x is accepted
    w = torch.randn(n, k, generator=g).to(DEVICE)
    got = linear_gemv(x, w)
    want = F.linear(x, w)
    assert got.shape == (m, n) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert linear_gemv(x[:0], w).shape == (0, n)


def test_dispatch_keeps_linear_off_cuda_and_for_many_rows():
    w = torch.randn(7, 64)
    for rows in (1, 9):
        x = torch.randn(rows, 64)
        assert torch.equal(decode_linear(x, w), F.linear(x, w))
    # what the kernel takes on a GPU: decode rows of a small weight of x's dtype
    from flashnext.ops.linear_gemv_triton import MAX_ROWS, MAX_WEIGHT_BYTES, supports

    assert supports(torch.randn(MAX_ROWS, 64), w) and not supports(torch.randn(MAX_ROWS + 1, 64), w)
    assert not supports(torch.randn(1, 64).double(), w)
    big = torch.empty(MAX_WEIGHT_BYTES // (64 * 4) + 1, 64)            # the 16-bit stacks of a bf16 model's qkv
    assert not supports(torch.randn(1, 64), big)
