"""QSA decode key bookkeeping: the Triton kernel (TRITON_INTERPRET=1 on CPU) leaves the same pooled keys and ring
as the torch reference, over consecutive steps that complete blocks, with a strided raw key like q_proj's split.
(The reference itself is held to the eager model by tests/test_decode_step.py.)"""
import importlib.util

import pytest
import torch

from flashnext.models.layers.rope import RotaryEmbedding
from flashnext.ops.qsa_key_append import qsa_key_append_reference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("ratio,dim,rot,per_page", [(4, 32, 8, 4), (3, 48, 16, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_reference(ratio, dim, rot, per_page, dtype):
    from flashnext.ops.qsa_key_append_triton import qsa_key_append_triton

    g = torch.Generator().manual_seed(ratio + dim)
    slots = torch.tensor([3, 0, 2])
    table = torch.tensor([[5, 1, 7, 2], [0, 3, 4, 6], [8, 9, 10, 11]])
    weight = (torch.randn(dim, generator=g) * 0.2).to(dtype)
    inv_freq = RotaryEmbedding(rot, 10000.0).inv_freq
    states = {name: (torch.zeros(4, ratio - 1, dim, dtype=dtype), torch.zeros(12, per_page, dim, dtype=dtype))
              for name in ("kernel", "reference")}
    positions = torch.tensor([0, 5, 9])
    for _ in range(2 * ratio + 1):                                   # crosses block boundaries on every row
        wide = torch.randn(3, dim + 16, generator=g).to(dtype)
        raw = wide[:, 8: 8 + dim]
        for name, fn in (("kernel", qsa_key_append_triton), ("reference", qsa_key_append_reference)):
            ring, keys = states[name]
            fn(raw, ring, slots, positions, table, keys, weight, 1e-6, inv_freq)
        positions = positions + 1
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(states["kernel"][0], states["reference"][0], **tol)
    torch.testing.assert_close(states["kernel"][1], states["reference"][1], **tol)
    assert states["reference"][1].abs().sum() > 0


@pytest.mark.parametrize("start,rows", [(0, 1), (5, 2), (6, 3), (2, 9), (3, 16), (7, 33)])
@pytest.mark.parametrize("ratio,dtype", [(4, torch.float32), (3, torch.float32), (2, torch.float32),
                                         (4, torch.float16)])
def test_chained_rows_equal_the_reference_row_by_row(start, rows, ratio, dtype):
    """A chained batch (one sequence's consecutive tokens, models/decode_batch.py) in the kernel's two launches: the
    pooled keys of the blocks its rows complete and the whole ring equal appending the rows one by one — chains
    shorter than a block, starting inside one, spanning several — and no other key row is written. (The
    interpreter runs the programs one after another: a race between them shows on the GPU only,
    scripts/gpu_decode.py's follow-up turns.)"""
    from flashnext.ops.qsa_key_append import qsa_key_append_chain_reference
    from flashnext.ops.qsa_key_append_triton import qsa_key_append_triton

    dim, rot, per_page, slot = 32, 8, 3, 2
    g = torch.Generator().manual_seed(start * 7 + rows)
    weight = (torch.randn(dim, generator=g) * 0.2).to(dtype)
    inv_freq = RotaryEmbedding(rot, 10000.0).inv_freq
    ring = torch.randn(4, ratio - 1, dim, generator=g).to(dtype)    # the earlier tokens' raw keys and stale rows
    keys = torch.randn(24, per_page, dim, generator=g).to(dtype)
    table = torch.randperm(24, generator=g)[None, :].expand(rows, -1)
    positions = torch.arange(start, start + rows)
    slots = torch.full((rows,), slot)
    raw = torch.randn(rows, dim + 8, generator=g).to(dtype)[:, 4: 4 + dim]
    got, want = (ring.clone(), keys.clone()), (ring.clone(), keys.clone())
    qsa_key_append_triton(raw, *got[:1], slots, positions, table, got[1], weight, 1e-6, inv_freq, chained=True)
    qsa_key_append_chain_reference(raw, *want[:1], slots, positions, table, want[1], weight, 1e-6, inv_freq)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got[0], want[0], **tol)
    completed = positions[positions % ratio == ratio - 1] // ratio
    key_rows = table[0, completed // per_page] * per_page + completed % per_page
    torch.testing.assert_close(got[1].view(-1, dim)[key_rows], want[1].view(-1, dim)[key_rows], **tol)
    untouched = torch.ones(24 * per_page, dtype=torch.bool)
    untouched[key_rows] = False
    assert torch.equal(got[1].view(-1, dim)[untouched], keys.view(-1, dim)[untouched])
