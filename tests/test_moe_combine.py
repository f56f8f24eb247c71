"""The MoE's last step (ops/moe_combine.py): the Triton kernel (CPU: TRITON_INTERPRET=1) against the reference, and
the reference against a per-token loop written from the definition."""
import pytest
import torch

from flashnext.ops.moe_combine import combine_choices_reference


def make(m, k, hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(m * k + 5, hidden + 3, generator=gen).to(dtype)[:, :hidden]   # a row stride past hidden
    position = torch.randperm(m * k + 5, generator=gen)[: m * k].view(m, k)
    weights = torch.rand(m, k, generator=gen).to(dtype)
    return rows, position, weights


def test_reference_is_the_definition():
    rows, position, weights = make(7, 3, 20, torch.float32)
    want = torch.stack([sum(weights[t, j] * rows[position[t, j]] for j in range(3)) for t in range(7)])
    assert torch.allclose(combine_choices_reference(rows, position, weights, torch.float32), want, atol=1e-6)


@pytest.mark.parametrize("m,k,hidden,dtype", [(9, 10, 1100, torch.float32), (4, 3, 37, torch.float16), (0, 2, 8, torch.float32)])
def test_triton_matches_reference(m, k, hidden, dtype):
    from flashnext.ops.moe_combine_triton import combine_choices_triton

    rows, position, weights = make(m, k, hidden, dtype, seed=m)
    want = combine_choices_reference(rows, position, weights, dtype)
    got = combine_choices_triton(rows, position, weights, dtype)
    assert got.dtype == dtype and got.shape == (m, hidden)
    assert torch.allclose(got.float(), want.float(), rtol=1e-3 if dtype == torch.float16 else 1e-6, atol=1e-6)
