"""The INT4 MoE decode kernels (interpreted on CPU) equal the torch reference: odd sizes, M = 1, 2, 5;
symmetric, asymmetric and act-order weights; one or several K splits; tokens sharing experts. fp32 and fp16
activations only: the Triton interpreter gets bf16 wrong (bf16 is checked on the GPU, scripts/gpu_moe.py)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from flashnext.ops.moe_int4 import moe_int4_reference
from oracle import rel_err
from test_moe_int4 import random_int4

triton = pytest.importorskip("triton", reason="triton is not importable: the INT4 MoE decode kernels are not tested")

E, H, I = 7, 64, 48


def case(m, k, g_up, g_down, asym=False, act_order=False, shared=False, seed=0):
    w_gate_up = random_int4(E, 2 * I, H, g_up, asym, act_order, seed)
    w_down = random_int4(E, H, I, g_down, asym, act_order, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(m, H, generator=gen)
    if shared:  # every token picks from the same few experts, in different slots
        ids = torch.stack([torch.roll(torch.arange(k), t) for t in range(m)])
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(m)])
    return x, ids, torch.randn(m, k, generator=gen), w_gate_up, w_down


# (M, k, g for gate_up, g for down, asym, act_order, shared experts, config)
CASES = [
    (1, 3, 32, 16, False, False, False, dict(block_n=32, block_k=32)),                          # I = 48: a half tile
    (1, 3, 32, 48, True, False, False, dict(block_n=16, block_k=32, split_k=2, split_down=3)),  # g 48: bk 16
    (2, 3, 32, 16, False, True, True, dict(block_n=32, block_k=32, split_k=2)),
    (5, 3, 64, 48, True, True, True, dict(block_n=64, block_k=64, split_down=3)),
    (5, 1, 32, 16, True, False, False, dict(block_n=64, block_k=32)),                          # k = 1: a direct store
    (2, 3, 16, 16, False, False, False, dict()),                                               # the defaults
    (3, 3, 32, 16, True, False, False, dict(block_n=16, down_block_n=64, block_k=32, split_down=2)),  # down's tiles
]


@pytest.mark.parametrize("m,k,g_up,g_down,asym,act_order,shared,config", CASES)
def test_decode_equals_reference(m, k, g_up, g_down, asym, act_order, shared, config):
    from flashnext.ops.moe_int4_decode_triton import DecodeConfig, moe_int4_decode

    x, ids, weights, w_gate_up, w_down = case(m, k, g_up, g_down, asym, act_order, shared)
    got = moe_int4_decode(x, ids, weights, w_gate_up, w_down, DecodeConfig(**config))
    assert got.dtype == x.dtype and got.shape == x.shape
    assert rel_err(got, moe_int4_reference(x, ids, weights, w_gate_up, w_down)) < 1e-5


def test_decode_fp16_activations():
    from flashnext.ops.moe_int4_decode_triton import DecodeConfig, moe_int4_decode

    x, ids, weights, w_gate_up, w_down = case(2, 3, 32, 16, asym=True)
    x, weights = x.half(), weights.half()
    got = moe_int4_decode(x, ids, weights, w_gate_up, w_down, DecodeConfig(block_n=64, block_k=32, split_k=2))
    assert got.dtype == torch.float16
    # Only the output is rounded to fp16 (h stays fp32).
    assert rel_err(got, moe_int4_reference(x.float(), ids, weights.float(), w_gate_up, w_down)) < 1e-3


def test_decode_token_bits_independent_of_batch():
    """A token's output has the same bits alone and in a batch (the splits do not depend on M), and the
    arrival counters are left zeroed for the next call."""
    from flashnext.ops.arrival import buffers
    from flashnext.ops.moe_int4_decode_triton import DecodeConfig, moe_int4_decode

    x, ids, weights, w_gate_up, w_down = case(3, 3, 32, 16, asym=True)
    config = DecodeConfig(block_n=64, block_k=32, split_k=2, split_down=2)
    batch = moe_int4_decode(x, ids, weights, w_gate_up, w_down, config)
    alone = moe_int4_decode(x[1:2], ids[1:2], weights[1:2], w_gate_up, w_down, config)
    assert torch.equal(batch[1:2], alone)
    assert buffers(x.device) and not any(buf.any() for buf in buffers(x.device))


def shared_expert(m, g_up, g_down, asym, seed=5):
    """A shared expert in the routed experts' forms (one expert of a stack), and a gate logit per token with a row
    stride of its own (as a column of the router's output)."""
    from flashnext.ops.moe_int4 import SharedExpert

    def one(w):
        pick = (lambda t: None if t is None else t[0].contiguous())
        return type(w)(pick(w.qweight), pick(w.scales), pick(w.zeros), None, w.group_size)

    logits = torch.randn(m, 5, generator=torch.Generator().manual_seed(seed))
    return SharedExpert(one(random_int4(1, 2 * I, H, g_up, asym, False, seed)),
                        one(random_int4(1, H, I, g_down, asym, False, seed + 1)), logits[:, 3:4])


@pytest.mark.parametrize("m,k,asym,config", [
    (1, 3, False, dict(block_n=32, block_k=32)),
    (2, 3, True, dict(block_n=16, block_k=32, split_k=2, split_down=2)),
    (3, 1, False, dict(block_n=64, down_block_n=16, block_k=16)),
])
def test_decode_runs_the_shared_expert_as_one_more_slot(m, k, asym, config):
    """With a shared expert the kernels add sigmoid(logit) × its output to the routed sum (one more slot per token)."""
    from flashnext.ops.moe_int4 import moe_int4_reference
    from flashnext.ops.moe_int4 import shared_fits
    from flashnext.ops.moe_int4_decode_triton import DecodeConfig, moe_int4_decode

    x, ids, weights, w_gate_up, w_down = case(m, k, 32, 16, asym=asym)
    shared = shared_expert(m, 32, 16, asym)
    assert shared_fits(w_gate_up, w_down, shared.gate_up, shared.down)
    got = moe_int4_decode(x, ids, weights, w_gate_up, w_down, DecodeConfig(**config), shared=shared)
    want = moe_int4_reference(x, ids, weights, w_gate_up, w_down, shared)
    assert rel_err(got, want) < 1e-5
    from flashnext.ops.arrival import buffers
    assert not any(buf.any() for buf in buffers(x.device))   # the extra slot's arrivals leave the counters zeroed
    routed_only = moe_int4_reference(x, ids, weights, w_gate_up, w_down)
    assert rel_err(routed_only, want) > 1e-2   # the shared term is there to be missed


def test_the_grouped_kernels_do_not_take_a_shared_expert(monkeypatch):
    """Above DECODE_MAX_M rows (prefill, or a decode batch of more sequences) the model must run the shared expert
    on its own: runs_shared_expert says so, and moe_int4 refuses one rather than run it some slow way."""
    from types import SimpleNamespace

    from flashnext.ops import moe_int4 as ops

    cuda_rows = lambda m: SimpleNamespace(is_cuda=True, shape=(m, H))   # noqa: E731 - the decision reads only these
    assert ops.runs_shared_expert(cuda_rows(ops.DECODE_MAX_M)) and not ops.runs_shared_expert(cuda_rows(ops.DECODE_MAX_M + 1))
    assert ops.runs_shared_expert(torch.zeros(300, H))                  # the CPU reference takes one at any M
    monkeypatch.setattr(ops, "_BACKEND", "grouped")
    assert not ops.runs_shared_expert(cuda_rows(1))
    x, ids, weights, w_gate_up, w_down = case(1, 3, 32, 16)
    with pytest.raises(ValueError, match="shared expert"):
        ops.moe_int4(cuda_rows(9), ids, weights, w_gate_up, w_down, shared_expert(9, 32, 16, False))


def test_shared_expert_must_match_the_routed_forms():
    from flashnext.ops.moe_int4 import shared_fits

    _, _, _, w_gate_up, w_down = case(1, 3, 32, 16, asym=False)
    assert not shared_fits(w_gate_up, w_down, *[shared_expert(1, 32, 16, asym=True).__dict__[n]
                                                for n in ("gate_up", "down")])   # zeros on one side only
    other_group = shared_expert(1, 16, 16, asym=False)
    assert not shared_fits(w_gate_up, w_down, other_group.gate_up, other_group.down)


def pool_of(w, experts, slots):
    """An expert cache's pool: `slots` rows, experts[i] copied into row i, the rest left zero."""
    def pick(t):
        if t is None:
            return None
        pool = torch.zeros((slots, *t.shape[1:]), dtype=t.dtype)
        pool[:len(experts)] = t[experts]
        return pool
    return type(w)(pick(w.qweight), pick(w.scales), pick(w.zeros), pick(w.perm), w.group_size)


@pytest.mark.parametrize("asym,act_order", [(False, False), (True, True)])
def test_decode_through_an_expert_cache_pool_equals_reference(asym, act_order):
    """CachedExperts: resident experts read from their pool slot, the others from the host store (here another CPU
    tensor; page-locked memory read over PCIe on a GPU): the same result as the whole stack."""
    from flashnext.ops.moe_int4 import CachedExperts
    from flashnext.ops.moe_int4_decode_triton import DecodeConfig, moe_int4_decode

    x, ids, weights, w_gate_up, w_down = case(3, 3, 32, 16, asym, act_order, seed=7)
    resident = [ids[0, 1].item(), ids[2, 0].item(), (ids.max().item() + 1) % E]   # two used, one not
    slots = 5
    table = torch.full((E,), -1, dtype=torch.long)
    order = [3, 0, 4]                       # pool rows in another order than the experts'
    table[resident] = torch.tensor(order)
    rows = [resident[order.index(r)] if r in order else 0 for r in range(slots)]
    gate_up_pool, down_pool = pool_of(w_gate_up, rows, slots), pool_of(w_down, rows, slots)
    # the residents' host rows spoiled: a kernel that read them there instead of from the pool would be wrong
    spoiled = [pool_of(w, list(range(E)), E) for w in (w_gate_up, w_down)]
    for w in spoiled:
        w.qweight[resident] = 0
    config = DecodeConfig(block_n=32, block_k=32, split_k=2)
    got = moe_int4_decode(x, ids, weights, gate_up_pool, down_pool, config, cached=CachedExperts(table, *spoiled))
    want = moe_int4_decode(x, ids, weights, w_gate_up, w_down, config)
    assert torch.equal(got, want)           # the same words, read from one place or the other
    assert rel_err(got, moe_int4_reference(x, ids, weights, w_gate_up, w_down)) < 1e-5
    table.fill_(-1)                         # nothing resident: every expert read from the host store
    cached = CachedExperts(table, w_gate_up, w_down)
    assert torch.equal(moe_int4_decode(x, ids, weights, gate_up_pool, down_pool, config, cached=cached), want)


def test_padding_rows_of_a_cached_step_are_skipped(monkeypatch):
    """A captured decode step runs a bucket of rows, the last ones padding: with CachedExperts.live_rows the kernels
    skip them (zeros out, their experts never read from the host store), the live rows keep their bits, and the
    arrival counters stay clean for the next call; the CPU reference zeroes them alike."""
    from flashnext.ops.moe_int4 import CachedExperts, moe_int4
    from flashnext.ops.moe_int4_decode_triton import DecodeConfig, moe_int4_decode

    empty = torch.empty

    def dirty(*args, **kwargs):   # scratch and outputs full of NaN, so a row nobody wrote cannot pass for zeros
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", dirty)

    x, ids, weights, w_gate_up, w_down = case(5, 3, 32, 16, asym=True, seed=11)
    config = DecodeConfig(block_n=32, block_k=32, split_k=2, split_down=2)
    table = torch.full((E,), -1, dtype=torch.long)       # nothing resident: every expert from the host store
    want = moe_int4_decode(x, ids, weights, w_gate_up, w_down, config)
    live = torch.tensor([3], dtype=torch.int32)
    for n in (3, 5):
        live.fill_(n)
        got = moe_int4_decode(x, ids, weights, w_gate_up, w_down, config,
                              cached=CachedExperts(table, w_gate_up, w_down, live))
        assert torch.equal(got[:n], want[:n]) and not got[n:].any()
        ref = moe_int4(x, ids, weights, w_gate_up, w_down, cached=CachedExperts(table, w_gate_up, w_down, live))
        assert rel_err(ref[:n], want[:n]) < 1e-5 and not ref[n:].any()


@pytest.mark.parametrize("asym,act_order,g_up", [(False, False, 32), (True, True, 64)])   # 64: two K tiles a group
def test_admitted_experts_are_written_into_their_slots_as_they_are_read(asym, act_order, g_up):
    """An expert admitted in this step (table ≤ -2, ops/expert_claims.py) is read from the host store and written
    into its slot by the kernels — every tensor of both weights, the slot's other rows and the other slots left
    alone — as the CPU reference does; a padding row's experts are not written. The output is unchanged."""
    from flashnext.ops.moe_int4 import CachedExperts, moe_int4
    from flashnext.ops.moe_int4_decode_triton import DecodeConfig, moe_int4_decode

    x, ids, weights, w_gate_up, w_down = case(3, 3, g_up, 16, asym, act_order, seed=5)
    slots = 4
    admitted = [ids[0, 0].item(), ids[1, 2].item()]
    padding_only = next(e for e in range(E) if e not in ids[:2].flatten().tolist())
    ids[2] = padding_only                   # the third row is padding: its expert must not be written
    table = torch.full((E,), -1, dtype=torch.long)
    table[admitted[0]], table[admitted[1]], table[padding_only] = -(2 + 2), -(0 + 2), -(3 + 2)
    live = torch.tensor([2], dtype=torch.int32)
    config = DecodeConfig(block_n=32, block_k=32, split_k=2, split_down=2)
    want = moe_int4_decode(x, ids, weights, w_gate_up, w_down, config)
    for run in ("kernels", "reference"):
        pools = [pool_of(w, [0] * slots, slots) for w in (w_gate_up, w_down)]
        for pool in pools:
            for t in pool.tensors().values():
                t.zero_()
        cached = CachedExperts(table, w_gate_up, w_down, live, admits=True)
        if run == "kernels":
            got = moe_int4_decode(x, ids, weights, *pools, config, cached=cached)
            assert torch.equal(got[:2], want[:2])
        else:
            moe_int4(x, ids, weights, *pools, cached=cached)
        for pool, w in zip(pools, (w_gate_up, w_down)):
            for name, t in pool.tensors().items():
                host = getattr(w, name)
                assert torch.equal(t[2], host[admitted[0]]) and torch.equal(t[0], host[admitted[1]]), (run, name)
                assert not t[1].any() and not t[3].any(), (run, name)    # a slot nobody was admitted to, the padding's


@pytest.mark.parametrize("through_cache,with_shared", [(False, False), (True, False), (False, True)])
def test_choices_of_weight_zero_are_skipped(through_cache, with_shared):
    """Expert parallel hands a rank the other ranks' choices with weight 0 (parallel/layers.py): the kernels skip
    them, nothing of their expert read — here an expert whose scales are NaN, which a computed pair would spread
    (NaN × 0) — and equal the reference, which skips them too."""
    from flashnext.ops.moe_int4 import CachedExperts
    from flashnext.ops.moe_int4_decode_triton import DecodeConfig, moe_int4_decode

    x, _, weights, w_gate_up, w_down = case(3, 3, 32, 16, asym=True, seed=5)
    gen = torch.Generator().manual_seed(6)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:3] for _ in range(3)])
    ids[:, 1] = E - 1                 # every token's second choice: another rank's, weight 0
    weights[:, 1] = 0.0
    weights[0, 2] = 0.0               # the last routed slot at 0 too: the shared expert's slot after it still counts
    for w in (w_gate_up, w_down):
        w.scales[E - 1] = float("nan")
    config = DecodeConfig(block_n=32, block_k=32, split_k=2, split_down=2)
    cached = CachedExperts(torch.full((E,), -1, dtype=torch.long), w_gate_up, w_down) if through_cache else None
    shared = shared_expert(3, 32, 16, True) if with_shared else None
    got = moe_int4_decode(x, ids, weights, w_gate_up, w_down, config, shared=shared, cached=cached)
    want = moe_int4_reference(x, ids, weights, w_gate_up, w_down, shared)
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-5
