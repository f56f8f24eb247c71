"""Prefill steps with their row-wise calls on padded static buffers (engine/row_graphs.py; captured into CUDA graphs
on a GPU, run eagerly on them here): the same logits, states, KV rows and pooled index keys as the plain eager
forward, for every architecture, on the pass that builds a bucket's plan and on later passes of other lengths, with
a prefix and with several sequences in one step; a model's wiring that reads an overwritten buffer is refused; and
through the engine a conversation gives the eager engine's tokens."""
import pytest
import torch

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.state_pool import StatePool
from flashnext.engine.row_graphs import LARGE_STEP, MIN_BUCKET, RowGraphs, bucket_rows, buckets_up_to
from flashnext.models.context import ForwardContext, Segment
from oracle import hf_model, ours_from_hf, rel_err
from test_model_parity import CASES, IDS

TOL = 1e-5


def test_buckets_are_powers_of_two_then_steps():
    assert bucket_rows(1) == MIN_BUCKET and bucket_rows(MIN_BUCKET) == MIN_BUCKET
    assert bucket_rows(MIN_BUCKET + 1) == 2 * MIN_BUCKET and bucket_rows(1000) == 1024
    assert bucket_rows(1025) == 1024 + LARGE_STEP and bucket_rows(4000) == 4096
    assert buckets_up_to(3000) == [64, 128, 256, 512, 1024, 1536, 2048, 2560, 3072]
    assert all(bucket_rows(n) >= n and bucket_rows(bucket_rows(n)) == bucket_rows(n) for n in range(1, 5000))
    graphs = RowGraphs("cpu", 100)
    assert graphs.max_rows == 128 and graphs.plan(129) is None and graphs.plan(100).bucket == 128
    assert graphs.plan(100, slot=2).single and not graphs.plan(100).single   # one sequence's mixing: by default
    graphs = RowGraphs("cpu", 100, sequences=False)
    assert not graphs.plan(100, slot=2).single


def _pools(cfg):
    kv = KVPool(cfg, 80, KVPool.fit_block_size(cfg, 8), torch.float32, "cpu")
    return kv, StatePool(cfg, 4, torch.float32, "cpu")


def _step(model, kv, states, segments, ids, pieces=None):
    """One forward of `segments` (slot, table, tokens, context) → the logits of each segment's last token."""
    flat, start = [], 0
    for slot, table, tokens, context in segments:
        flat.append(Segment(slot, torch.tensor(table), start, len(tokens), context))
        start += len(tokens)
    hidden = model(torch.cat(ids), ForwardContext(flat, kv, states, pieces=pieces))
    if pieces is not None:
        pieces.end()
    return model.compute_logits(hidden[torch.tensor([s.end - 1 for s in flat])])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_row_graph_steps_equal_eager_steps(case):
    arch, overrides = case
    hf, raw = hf_model(arch, seed=CASES.index(case), **overrides)
    model = ours_from_hf(hf, raw)
    cfg = model.cfg
    g = torch.Generator().manual_seed(3)
    tokens = lambda n: torch.randint(2, cfg.vocab_size, (n,), generator=g)  # noqa: E731
    first, follow, other, short = tokens(23), tokens(41), tokens(9), tokens(2)
    eager, padded = _pools(cfg), _pools(cfg)
    tables = [[pools[0].allocate(pools[0].blocks_for(80)) for _ in range(2)] for pools in (eager, padded)]
    slots = [[pools[1].allocate() for _ in range(2)] for pools in (eager, padded)]
    assert tables[0] == tables[1] and slots[0] == slots[1]
    (ta, tb), (sa, sb) = tables[0], slots[0]
    graphs = RowGraphs("cpu", 128, sequences=True)
    steps = [  # (segments of (slot, table, tokens, context)): the bucket's first pass, then two more of other lengths
        [(sa, ta, first, 0)],
        [(sa, ta, follow, len(first))],                                  # a prefix: the QSA selection is scored
        [(sb, tb, other, 0), (sa, ta, first[:5], len(first) + len(follow))],   # two sequences in one step
        [(sb, tb, short, len(other))],   # fewer rows than the conv's tail, the delta rule token by token eagerly
    ]
    with torch.inference_mode():
        for segments in steps:
            ids = [s[2] for s in segments]
            want = _step(model, *eager, segments, ids)
            rows = sum(len(i) for i in ids)
            got = _step(model, *padded, segments, ids, graphs.plan(rows, segments[0][0] if len(segments) == 1 else None))
            assert rel_err(got, want) < TOL
    assert set(graphs.plans) == {(MIN_BUCKET, True), (MIN_BUCKET, False)}
    for single, plan in ((True, graphs.plans[MIN_BUCKET, True]), (False, graphs.plans[MIN_BUCKET, False])):
        sites = [c.site for c in plan.calls]
        assert plan.captured and sites[0] == "embed" and sites.count("mlp") == cfg.num_layers
        # one sequence's steps also hold GatedDeltaNet's token mixing (its padding rows leave the states alone)
        assert sites.count("gdn_mix") == (len(cfg.layer_types) - len(cfg.attention_layers()) if single else 0)
    for name, t in eager[1].tensors().items():
        for slot, total in ((sa, len(first) + len(follow) + 5), (sb, len(other) + len(short))):
            held = slice(total % cfg.indexer_compress_ratio) if name.startswith("index_ring") else slice(None)
            assert rel_err(padded[1].tensors()[name][slot][held].float(), t[slot][held].float()) < TOL, name
    rows = eager[0].token_rows(torch.tensor(ta), 0, len(first) + len(follow) + 5)
    for layer in cfg.attention_layers():
        for cache in ("k", "v"):
            got, want = (getattr(pools[0], cache)[layer].flatten(0, 1)[rows] for pools in (padded, eager))
            assert rel_err(got, want) < TOL, (cache, layer)


class _Wiring(torch.nn.Module):
    """Two row-wise sites; `stale` reads the first site's output after a second call of it overwrote its buffer."""

    def forward(self, x, ctx, stale=False):
        a = ctx.rows("double", lambda t: 2 * t, x)
        b = ctx.rows("double", lambda t: 2 * t, a)
        return ctx.rows("add", torch.add, a if stale else b, b)


def _ctx(rows, plan):
    kv = type("KV", (), {"device": torch.device("cpu")})()
    return ForwardContext([Segment(0, torch.zeros(1, dtype=torch.long), 0, rows, 0)], kv, None, pieces=plan)


def test_a_read_of_an_overwritten_buffer_is_refused_and_a_plan_is_replayed_as_made():
    x = torch.arange(5.0)[:, None]
    graphs = RowGraphs("cpu", 64)
    with pytest.raises(RuntimeError, match="overwrote"):
        _Wiring()(x, _ctx(5, graphs.plan(5)), stale=True)
    plan = graphs.plan(5)   # the failed first pass starts over
    out = _Wiring()(x, _ctx(5, plan))
    plan.end()
    assert out.shape == (64, 1) and torch.equal(out[:5], 8 * x) and not out[5:].any()
    plan = graphs.plan(3)
    assert torch.equal(_Wiring()(2 * x[:3], _ctx(3, plan))[:3], 16 * x[:3])
    plan.end()
    plan = graphs.plan(3)
    with pytest.raises(RuntimeError, match="is add, its plan's double"):
        plan.call("add", torch.add, (x, x))


def test_a_failed_capture_finishes_its_pass_eagerly_and_turns_the_graphs_off(monkeypatch):
    """A capture that fails (on a GPU: a host sync inside a call, say) is released as RowGraphs.capture does: the pass
    goes on from that call's eager run and eagerly after it, with the same result; later steps get no plan."""
    x = torch.arange(5.0)[:, None]
    graphs = RowGraphs("cpu", 64)
    captured = RowGraphs.capture

    def fail_second(self, body, calls=[]):   # noqa: B006 - counts the captures of this test
        calls.append(body)
        if len(calls) == 2:
            self.release()
            return None
        return captured(self, body)

    monkeypatch.setattr(RowGraphs, "capture", fail_second)
    plan = graphs.plan(5)
    out = _Wiring()(x, _ctx(5, plan))
    plan.end()
    assert torch.equal(out[:5], 8 * x) and not graphs.enabled and graphs.plan(5) is None and not graphs.buffers


@pytest.mark.parametrize("sequences", [False, True], ids=["mixing-eager", "mixing-captured"])
def test_engine_conversation_through_row_graphs_gives_the_eager_tokens(sequences):
    """A CPU engine whose eager steps of up to 64 tokens take row-wise plans (as a GPU engine's do up to
    --graph-prefill-max), with one sequence's GatedDeltaNet mixing in them or not: a conversation's turns, with prefix
    hits, give the eager engine's tokens."""
    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine
    from test_decode_runner import follow_up_conversation

    args, conversation = follow_up_conversation()
    want = conversation(LLMEngine(EngineArgs(**args)))
    engine = LLMEngine(EngineArgs(**args))
    engine.runner.row_graphs = RowGraphs("cpu", 64, sequences=sequences)
    assert conversation(engine) == want
    plans = engine.runner.row_graphs.plans
    assert (MIN_BUCKET, sequences) in plans and all(p.captured and p.calls for p in plans.values())
