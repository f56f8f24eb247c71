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
