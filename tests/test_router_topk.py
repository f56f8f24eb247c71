"""Routing (softmax → top-k → renormalise): the Triton kernel under TRITON_INTERPRET=1 equals the reference,
and the reference is what the model's Router computes (the parity tests hold it to transformers)."""
import importlib.util

import pytest
import torch

from flashnext.ops.router_topk import router_topk_reference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("rows,experts,top_k,normalize", [(1, 512, 10, True), (5, 8, 2, True), (3, 256, 8, False),
                                                          (4, 37, 5, True), (0, 16, 2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_reference(rows, experts, top_k, normalize, dtype):
    from flashnext.ops.router_topk_triton import router_topk_triton

    logits = (torch.randn(rows, experts, generator=torch.Generator().manual_seed(rows + experts)) * 3).to(dtype)
    want_w, want_ids = router_topk_reference(logits, top_k, normalize)
    got_w, got_ids = router_topk_triton(logits, top_k, normalize)
    assert got_ids.dtype == torch.long and got_w.dtype == dtype
    # Same experts in the same order (random logits: no ties), same weights to the last bits of the dtype.
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=1e-6)


def test_strided_logits():
    from flashnext.ops.router_topk_triton import router_topk_triton

    wide = torch.randn(3, 80, generator=torch.Generator().manual_seed(1))
    logits = wide[:, 10:74]
    got_w, got_ids = router_topk_triton(logits, 4, True)
    want_w, want_ids = router_topk_reference(logits, 4, True)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)


@pytest.mark.parametrize("rows,experts,extra,k_in,top_k", [(1, 64, 8, 96, 10), (3, 37, 3, 50, 5), (2, 512, 8, 64, 10)])
def test_gemv_and_topk_in_one_launch(rows, experts, extra, k_in, top_k):
    """router_gemv_topk_triton: the logits are the GEMV's (the shared-gate and padding rows included), the routing
    the reference's of the experts' logits — the last program sees every program's logits — and the arrival
    counter is left zeroed for the next launch."""
    from flashnext.ops.arrival import buffers
    from flashnext.ops.linear_gemv_triton import linear_gemv
    from flashnext.ops.router_topk_triton import router_gemv_topk_triton

    g = torch.Generator().manual_seed(rows * experts)
    x = torch.randn(rows, k_in, generator=g)
    weight = torch.randn(experts + extra, k_in, generator=g)
    logits, weights, ids = router_gemv_topk_triton(x, weight, experts, top_k, True)
    assert torch.equal(logits, linear_gemv(x, weight))
    want_w, want_ids = router_topk_reference(logits[:, :experts], top_k, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    assert not any(buf.any() for buf in buffers(x.device))


def test_route_without_the_fused_kernel_is_gemv_then_topk():
    """Off CUDA (or without FLASHNEXT_ROUTER_FUSED_TOPK=1) route is the linear, then router_topk of the experts'
    columns: the model's routing through it equals the Router's own."""
    from flashnext.ops.router_topk import route

    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(4, 32, generator=g), torch.randn(21, 32, generator=g)
    logits, weights, ids = route(x, weight, 16, 3, True)
    assert torch.equal(logits, x @ weight.t())
    want_w, want_ids = router_topk_reference(logits[:, :16], 3, True)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
