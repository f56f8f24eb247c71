"""Paged decode attention: the reference against plain per-sequence SDPA over gathered rows (dense and
sparse), and the Triton split-K kernel (CPU: TRITON_INTERPRET=1) against the reference at odd sizes."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from flashnext.ops.decode_attention import decode_attention, decode_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def make_case(lens, heads, kv_heads, dim, page, width=None, picks=None, dtype=torch.float32, seed=0):
    """Pages shuffled over a pool with spare pages; table entries past a sequence hold random page ids.
    picks: T for a sparse selection — each row marks min(T, len) - 1 (at least one) distinct positions
    valid at shuffled slots; the other entries are invalid and hold random positions in [0, W·BS) (past
    the length, or repeating a valid one)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lens]
    width = width or max(max(need), 1) + 1
    pages = sum(need) + 3
    order = torch.randperm(pages, generator=gen).tolist()
    table = torch.randint(0, pages, (len(lens), width), generator=gen)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(order[:n], dtype=torch.long)
        order = order[n:]
    case = {
        "q": torch.randn(len(lens), heads, dim, generator=gen).to(dtype),
        "k_cache": torch.randn(pages, page, kv_heads, dim, generator=gen).to(dtype),
        "v_cache": torch.randn(pages, page, kv_heads, dim, generator=gen).to(dtype),
        "block_table": table, "seq_lens": torch.tensor(lens), "scale": dim ** -0.5}
    if picks:
        index = torch.randint(0, width * page, (len(lens), picks), generator=gen)
        valid = torch.zeros(len(lens), picks, dtype=torch.bool)
        for b, n in enumerate(lens):
            chosen = torch.randperm(n, generator=gen)[:max(min(picks, n) - 1, 1 if n else 0)]
            slots = torch.randperm(picks, generator=gen)[:len(chosen)]
            index[b, slots] = chosen
            valid[b, slots] = True
        case.update(token_index=index, token_valid=valid)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def per_sequence_sdpa(case):
    """The obvious loop: gather each sequence's rows position by position, SDPA in fp64."""
    q, k_cache, v_cache = case["q"].double(), case["k_cache"].double(), case["v_cache"].double()
    page = k_cache.shape[1]
    out = torch.zeros_like(q)
    for b, n in enumerate(case["seq_lens"].tolist()):
        pages = case["block_table"][b].tolist()
        k = torch.stack([k_cache[pages[p // page], p % page] for p in range(n)], 1)      # [KVH, L, D]
        v = torch.stack([v_cache[pages[p // page], p % page] for p in range(n)], 1)
        mask = torch.ones(n, dtype=torch.bool, device=q.device)
        if "token_index" in case:
            chosen = {int(p) for p, ok in zip(case["token_index"][b], case["token_valid"][b]) if ok}
            mask = torch.tensor([p in chosen for p in range(n)], device=q.device)
        out[b] = F.scaled_dot_product_attention(q[b][:, None], k, v, attn_mask=mask, scale=case["scale"],
                                                enable_gqa=True)[:, 0]
    return out


REFERENCE_CASES = [  # (lens, heads, kv_heads, dim, page)
    ([1, 7, 16, 33], 6, 2, 32, 4),
    ([5, 1, 40], 6, 2, 64, 16),
    ([17, 64], 4, 4, 32, 16),
]


@pytest.mark.parametrize("lens,heads,kv_heads,dim,page", REFERENCE_CASES)
@pytest.mark.parametrize("picks", [None, 9])
def test_reference_equals_per_sequence_sdpa(lens, heads, kv_heads, dim, page, picks):
    case = make_case(lens, heads, kv_heads, dim, page, picks=picks)
    got = decode_attention_reference(**case)
    assert got.shape == case["q"].shape and got.dtype == torch.float32
    assert rel_err(got, per_sequence_sdpa(case)) < 1e-5


def test_reference_gives_zeros_to_a_padded_slot():
    case = make_case([0, 9], 6, 2, 32, 4)
    got = decode_attention_reference(**case)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and bool(got[1].abs().sum() > 0)


def test_dispatch_off_cuda_is_the_reference():
    case = make_case([3, 12], 6, 2, 32, 4, picks=5)
    case = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    assert torch.equal(decode_attention(**case), decode_attention_reference(**case))


# --- Triton kernels (interpreted on CPU) ---------------------------------------------------------------

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not importable (pip install triton)")


@pytest.fixture(scope="module")
def kernels():
    from flashnext.ops import decode_attention_triton
    return decode_attention_triton


TRITON_CASES = [  # (lens, heads, kv_heads, dim, page, picks, (num_splits, block_n, min_split) or None)
    ([1, 7, 33, 16], 6, 2, 32, 4, None, None),
    ([1, 7, 33, 16], 6, 2, 32, 4, None, (3, 16, 16)),
    ([50, 3], 6, 2, 64, 16, None, (4, 16, 16)),      # 50 = 3 pages + 2: ends mid-page, mid-tile
    ([0, 21], 4, 4, 32, 16, None, (2, 16, 16)),      # a padded slot next to a real one
    ([1, 30, 45], 6, 2, 32, 4, 13, None),
    ([1, 30, 45], 6, 2, 32, 4, 13, (3, 16, 16)),
    ([40, 64], 6, 2, 64, 16, 37, (5, 16, 16)),       # more splits than the entries need
    ([0, 19], 4, 4, 32, 4, 7, (2, 16, 16)),
]


@needs_triton
@pytest.mark.parametrize("lens,heads,kv_heads,dim,page,picks,cfg", TRITON_CASES)
def test_triton_matches_reference(kernels, lens, heads, kv_heads, dim, page, picks, cfg):
    case = make_case(lens, heads, kv_heads, dim, page, picks=picks, seed=len(lens) + dim)
    config = kernels.LaunchConfig(*cfg) if cfg else None
    got = kernels.split_k_decode_attention(**case, config=config)
    want = decode_attention_reference(**case)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5
    if 0 in lens:
        assert torch.equal(got[lens.index(0)], torch.zeros_like(got[0]))


@needs_triton
def test_triton_all_valid_when_token_valid_is_none(kernels):
    case = make_case([12, 30], 6, 2, 32, 4, seed=3)
    case["token_index"] = torch.stack([torch.randperm(12)[:8], torch.randperm(30)[:8]]).to(DEVICE)
    got = kernels.split_k_decode_attention(**case, config=kernels.LaunchConfig(2, 16, 16))
    assert rel_err(got, decode_attention_reference(**case)) < 1e-5


@needs_triton
def test_triton_default_config_splits_long_tables(kernels):
    # Splits come from static sizes only; a sequence far shorter than its table still spreads over several.
    cfg = kernels.default_config(1, 2, 256, 65536, torch.device("cpu"))
    assert cfg.num_splits == 8 and cfg.min_split % cfg.block_n == 0
    assert kernels.default_config(1, 2, 256, 100, torch.device("cpu")).num_splits == 1
    case = make_case([300, 5], 6, 2, 32, 16, width=64, seed=5)
    assert kernels.default_config(2, 2, 32, 64 * 16, torch.device("cpu")).num_splits > 1
    assert rel_err(kernels.split_k_decode_attention(**case), decode_attention_reference(**case)) < 1e-5


@needs_triton
def test_triton_many_rows_of_token_lists_take_the_list_tiles(kernels):
    # A prefill chunk's token lists past 16K (one split a row at Flash-Next's head size) take LIST_ROWS' tiles; decode
    # rows and dense tables keep the split rule; the tiles' own arithmetic is checked here at a small head size.
    cpu = torch.device("cpu")
    assert kernels.default_config(4096, 2, 256, 2051, cpu, sparse=True) is kernels.LIST_ROWS
    assert kernels.default_config(4096, 2, 256, 2051, cpu) is not kernels.LIST_ROWS
    assert kernels.default_config(1, 2, 256, 2051, cpu, sparse=True).num_splits > 1
    lists = kernels.LIST_ROWS
    case = make_case([90, 130, 7], 6, 2, 32, 16, picks=70, seed=13)
    config = kernels.LaunchConfig(lists.num_splits, lists.block_n, lists.min_split, lists.num_warps, lists.num_stages)
    assert rel_err(kernels.split_k_decode_attention(**case, config=config), decode_attention_reference(**case)) < 1e-5


@needs_triton
@pytest.mark.parametrize("picks", [None, 11])
def test_triton_half_precision(kernels, picks):
    # fp16 rounds P to fp16 for P·V, as flash attention does. bf16 is only checked on the GPU
    # (scripts/gpu_decode_attention.py): Triton's interpreter gets bf16 tl.dot wrong.
    case = make_case([9, 40], 6, 2, 64, 16, picks=picks, dtype=torch.float16, seed=11)
    got = kernels.split_k_decode_attention(**case, config=kernels.LaunchConfig(3, 16, 16))
    assert got.dtype == torch.float16 and rel_err(got, decode_attention_reference(**case)) < 3e-3
