"""The pairs in expert order (ops/expert_order.py): the reference against a hand-worked example, and the Triton
counting sort (CPU: TRITON_INTERPRET=1) against the reference — the same sorted experts, ends and block table, an
order that is a permutation the sorted experts follow, and its inverse as position."""
import pytest
import torch

from flashnext.ops.expert_order import expert_order_reference, table_size


def test_reference_by_hand():
    ids = torch.tensor([[2, 0], [2, 1], [2, 0]])        # pairs 0..5: experts 2 0 2 1 2 0
    plan = expert_order_reference(ids, num_experts=4, block_m=2)
    assert plan.sorted_ids.tolist() == [0, 0, 1, 2, 2, 2]
    assert plan.order.tolist() == [1, 5, 3, 0, 2, 4]
    assert plan.position.tolist() == [3, 0, 4, 2, 5, 1]
    assert plan.ends.tolist() == [2, 3, 6, 6]
    # expert 0: rows 0-1 (one block), expert 1: row 2, expert 2: rows 3-4 and 5; then spare entries
    assert table_size(6, 4, 2) == 7
    assert plan.block_start.tolist() == [0, 2, 3, 5, -1, -1, -1]


# (tokens, k, experts, block_m, id dtype): one expert's run over several blocks, fewer pairs than a block, a single
# pair, more experts than pairs, no pairs, no block table (block_m None); ids as the router gives them (int64) or int32
CASES = [(300, 10, 64, 16, torch.int64), (5, 2, 8, 128, torch.int32), (1, 1, 4, 16, torch.int64),
         (100, 8, 512, 128, torch.int32), (0, 4, 16, 16, torch.int64), (300, 10, 64, None, torch.int64)]


@pytest.mark.parametrize("m,k,experts,block_m,dtype", CASES)
def test_triton_matches_reference(m, k, experts, block_m, dtype):
    from flashnext.ops.expert_order_triton import expert_order_triton

    gen = torch.Generator().manual_seed(m)
    ids = torch.randint(0, experts, (m, k), generator=gen).to(dtype)
    ids[: m // 3, 0] = 3                                 # a heavy expert
    want = expert_order_reference(ids, experts, block_m)
    got = expert_order_triton(ids, experts, block_m)
    for name in ("sorted_ids", "ends"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    if block_m is None:
        assert got.block_start is None and want.block_start is None
    else:
        assert torch.equal(got.block_start, want.block_start)
    flat = ids.reshape(-1).to(torch.int32)
    assert sorted(got.order.tolist()) == list(range(m * k))
    assert torch.equal(flat[got.order.long()], got.sorted_ids)
    assert torch.equal(got.position[got.order.long()], torch.arange(m * k, dtype=torch.int32))
