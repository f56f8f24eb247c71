"""QSA decode block scores: the Triton kernel (TRITON_INTERPRET=1 on CPU) equals the torch reference (which the
decode-step tests hold to the eager model), through shuffled block tables, with incomplete blocks at -inf."""
import importlib.util

import pytest
import torch

from flashnext.ops.qsa_scores import qsa_block_scores_reference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("batch,heads,dim,per_page,width", [(1, 4, 32, 4, 3), (3, 4, 128, 4, 40), (2, 3, 48, 3, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_reference(batch, heads, dim, per_page, width, dtype):
    from flashnext.ops.qsa_scores_triton import qsa_block_scores_triton

    g = torch.Generator().manual_seed(batch * dim + width)
    keys = torch.randn(2 * width + 3, per_page, dim, generator=g).to(dtype)
    table = torch.stack([torch.randperm(2 * width + 3, generator=g)[:width] for _ in range(batch)])
    q = torch.randn(batch, heads + 1, dim, generator=g).to(dtype)[:, 1:]      # strided like the split q
    before = torch.randint(0, width * per_page + 1, (batch,), generator=g)
    got = qsa_block_scores_triton(q, keys, table, before)
    want = qsa_block_scores_reference(q, keys, table, before)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-4)


@pytest.mark.parametrize("length,blocks,dim", [(37, 21, 32), (16, 70, 16), (5, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_kernel_equals_reference(length, blocks, dim, dtype):
    """Many queries against one sequence's block keys (the indexer's prefill), odd sizes, strided q."""
    from flashnext.ops.qsa_scores import qsa_prefill_scores_reference
    from flashnext.ops.qsa_scores_triton import qsa_prefill_scores_triton

    g = torch.Generator().manual_seed(length * blocks)
    q = torch.randn(length, 5, dim, generator=g).to(dtype)[:, 1:]
    keys = torch.randn(blocks, dim, generator=g).to(dtype)
    before = torch.randint(0, blocks + 1, (length,), generator=g)
    got = qsa_prefill_scores_triton(q, keys, before)
    want = qsa_prefill_scores_reference(q, keys, before)
    # rows padded to 16 blocks: the row stride the token lists read by is of one divisibility class at any context
    assert got.shape == want.shape and got.stride(0) % 16 == 0
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-4)
