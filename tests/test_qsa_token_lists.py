"""QSA token lists: the reference selects torch.topk's blocks (as a set, where the k-th score is not tied) and keeps
the contract of ops/qsa_token_lists.py; the Triton kernel (TRITON_INTERPRET=1 on CPU) equals the reference bit for
bit — rows longer than the kernel's register chunk, ties at the k-th score (lowest block index wins, −0.0 = 0.0),
−inf for incomplete blocks, fewer complete blocks than k."""
import importlib.util

import pytest
import torch

from flashnext.ops.qsa_token_lists import qsa_token_lists_reference, qsa_top_blocks_reference

def scored(rows: int, blocks: int, ratio: int, seed: int, ties: bool = False):
    """Scores as the indexer makes them: ≥ 0 (relu sums), −inf from each row's first incomplete block on; with
    `ties`, few distinct values (many exact ties, 0.0 and −0.0 among them)."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        scores = torch.randint(0, 4, (rows, blocks), generator=g).float()
        scores[torch.rand(rows, blocks, generator=g) < 0.2] = -0.0
    else:
        scores = torch.rand(rows, blocks, generator=g) * 3
    pos = torch.randint(0, blocks * ratio + ratio, (rows,), generator=g)
    complete_before = (pos + 1) // ratio
    scores[torch.arange(blocks)[None, :] >= complete_before[:, None]] = float("-inf")
    return scores, pos


@pytest.mark.parametrize("rows,blocks,k,ratio", [(3, 50, 8, 4), (5, 37, 37, 4), (2, 130, 17, 3)])
def test_reference_selects_the_top_blocks_in_order(rows, blocks, k, ratio):
    scores, pos = scored(rows, blocks, ratio, seed=blocks)
    limit = blocks * ratio
    index, valid = qsa_token_lists_reference(scores, pos, k, ratio, limit)
    assert index.shape == valid.shape == (rows, k * ratio + ratio - 1)
    complete_before = (pos + 1) // ratio
    for r in range(rows):
        top = scores[r].topk(k).indices
        finite = scores[r][top] > float("-inf")    # distinct finite scores: the set is topk's
        blocks_chosen = index[r, : k * ratio : ratio] // ratio
        assert torch.equal(blocks_chosen, blocks_chosen.sort().values)
        assert set(blocks_chosen.tolist()) >= set(top[finite].tolist())
        assert torch.equal(index[r, : k * ratio].view(k, ratio),
                           blocks_chosen[:, None] * ratio + torch.arange(ratio))
        assert torch.equal(valid[r, : k * ratio].view(k, ratio),
                           (blocks_chosen < complete_before[r])[:, None].expand(k, ratio))
        tail = complete_before[r] * ratio + torch.arange(ratio - 1)
        assert torch.equal(valid[r, k * ratio:], tail <= pos[r])
        assert torch.equal(index[r, k * ratio:], tail.clamp(max=limit - 1))


def test_reference_breaks_ties_toward_the_lower_block():
    scores = torch.tensor([[1.0, 2.0, -0.0, 2.0, 0.0, 0.0, float("-inf")]])
    index, _ = qsa_token_lists_reference(scores, torch.tensor([27]), 4, 4, 28)
    assert (index[0, :16:4] // 4).tolist() == [0, 1, 2, 3]       # −0.0 at block 2 ties with the 0.0 after it
    index, _ = qsa_token_lists_reference(scores, torch.tensor([27]), 3, 4, 28)
    assert (index[0, :12:4] // 4).tolist() == [0, 1, 3]


@pytest.fixture
def kernel():
    """The Triton module."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    import flashnext.ops.qsa_token_lists_triton as module

    return module


@pytest.mark.parametrize("rows,blocks,k,ratio,ties", [
    (3, 50, 8, 4, False), (4, 50, 8, 4, True), (2, 37, 37, 4, True), (5, 200, 64, 3, False), (1, 9, 1, 2, True),
    (3, 50, 8, 1, True)])
def test_kernel_equals_reference(kernel, rows, blocks, k, ratio, ties):
    """The lists (ratio 1: the blocks themselves, as the mask path takes them, qsa_top_blocks)."""
    scores, pos = scored(rows, blocks, ratio, seed=blocks + rows, ties=ties)
    limit = blocks * ratio
    got = kernel.qsa_token_lists_triton(scores, pos, k, ratio, limit)
    want = qsa_token_lists_reference(scores, pos, k, ratio, limit)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("blocks,k", [(56, 11), (56, 5), (40, 11)])
def test_kernel_rows_longer_than_its_chunk(kernel, monkeypatch, ties, blocks, k):
    """Rows longer than a 32-key chunk: 2 or 4 slices keep their top k (the last of 40 holds fewer than k blocks),
    the list kernel selects from those; strided scores."""
    monkeypatch.setattr(kernel, "CHUNK", 32)
    scores, pos = scored(3, blocks, 4, seed=blocks + k, ties=ties)
    scores = torch.cat([scores, scores], dim=1)[:, :blocks]
    got = kernel.qsa_token_lists_triton(scores, pos, k, 4, 4 * blocks)
    want = qsa_token_lists_reference(scores, pos, k, 4, 4 * blocks)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("ties", [False, True])
def test_kernel_top_blocks_equal_the_reference(kernel, ties):
    """What qsa_top_blocks runs on CUDA (the mask path of short prompts): the list kernel with one token a block and
    every block complete, whose list is the block list, against the reference's two sorts (−inf blocks included)."""
    scores, _ = scored(4, 60, 1, seed=5, ties=ties)
    scores[:, 50:] = float("-inf")
    got = kernel.qsa_token_lists_triton(scores, torch.full((4,), 59), 9, 1, 60)[0]
    assert torch.equal(got, qsa_top_blocks_reference(scores, 9))


def test_fits_says_where_the_kernels_select():
    """The dispatchers send CUDA rows to the kernels only where `fits` (else the reference): one program up to CHUNK
    scores, two stages while the slices' candidates (CHUNK // k slices of k) still fit one program."""
    from flashnext.ops.qsa_token_lists_triton import CHUNK, fits

    assert fits(CHUNK, CHUNK) and fits(32 * CHUNK, 512) and not fits(32 * CHUNK + 1, 512)
    assert not fits(CHUNK + 1, CHUNK // 2 + 1) and not fits(10, 11) and not fits(10, 0)
