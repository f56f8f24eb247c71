"""Benchmark routing with stated locality (cache/routing_trace.py): the generator has the published Flash-Next
locality, routers use it with their own softmax weights, and the engine runs with it (and with an expert cache)."""
import torch

from flashnext.cache.expert_trace import replay
from flashnext.cache.routing_trace import CalibratedRouting
from flashnext.engine.args import EngineArgs
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.sampling_params import SamplingParams
from flashnext.models.layers.moe import Router


def test_calibrated_locality_matches_the_published_lru_hit_rates():
    routing = CalibratedRouting(512, 10, seed=3)
    trace = [routing.choose() for _ in range(1500)]
    assert all(len(set(step)) == 10 for step in trace)
    rates = {}
    for slots in (64, 128):
        hits, misses = replay(trace, 512, slots, "lru")
        rates[slots] = hits / (hits + misses)
    assert abs(rates[64] - 0.67) < 0.03 and abs(rates[128] - 0.81) < 0.03, rates
    # no static hot set: over the run, most experts are used
    assert len({e for step in trace for e in step}) > 450


def test_router_takes_the_trace_with_its_own_weights():
    router = Router.__new__(Router)
    torch.nn.Module.__init__(router)
    router.top_k, router.normalize = 3, True
    router.trace = CalibratedRouting(16, 3, seed=1)
    expected = CalibratedRouting(16, 3, seed=1).ids(4, "cpu")
    logits = torch.randn(4, 16)
    weights, ids = router.select(logits)
    assert torch.equal(ids, expected)
    want = torch.softmax(logits, -1).gather(1, ids)
    torch.testing.assert_close(weights, want / want.sum(-1, keepdim=True))


def test_engine_runs_with_a_trace_and_an_expert_cache():
    engine = LLMEngine(EngineArgs(model="tiny-flash-next", device="cpu", dtype="float32", quantize="int4",
                                  routing_trace="calibrated", expert_vram_gb=1e-4, enable_prefix_caching=False))
    assert all(m.trace is not None for m in engine.loaded.model.modules() if isinstance(m, Router))
    engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_work():
        tokens += [t for o in engine.step() for t in o.token_ids]
    stats = engine.loaded.expert_cache.stats
    assert len(tokens) == 8 and stats.hits > 0 and stats.misses > 0


def test_decode_graph_path_with_a_trace_and_an_expert_cache():
    """With decode graphs (uncaptured on a CPU) the decode steps route from the trace's tables and read the expert
    cache through its slot tables; the pools admit inside the steps."""
    from flashnext.engine.cuda_graph import DecodeGraphs

    engine = LLMEngine(EngineArgs(model="tiny-flash-next", device="cpu", dtype="float32", quantize="int4",
                                  routing_trace="calibrated", expert_vram_gb=1e-4, enable_prefix_caching=False))
    runner, cache = engine.runner, engine.loaded.expert_cache
    runner.graphs = DecodeGraphs(runner.model, engine.kv, engine.states, max_batch=2,
                                 max_blocks_per_seq=engine.kv.blocks_for(engine.max_model_len))
    pool = cache.enable_graphs()
    runner.graphs.keeper = pool
    engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tokens = [t for o in engine.step() for t in o.token_ids]      # the prompt, eagerly: its reads counted there
    prefill_reads = cache.stats.hits + cache.stats.misses
    while engine.has_work():
        tokens += [t for o in engine.step() for t in o.token_ids]
    routers = [m for m in engine.loaded.model.modules() if isinstance(m, Router)]
    assert len(tokens) == 8 and all(r.trace.decode_table is not None for r in routers)
    assert all(r.trace.decode_table[1].item() >= 7 for r in routers)   # one table token per decode row
    pool.settle()                  # the counters reach the stats every 16 steps, or here
    assert cache.stats.hits + cache.stats.misses > prefill_reads        # the graph path's pools counted decode


def test_decode_steps_read_a_table_drawn_ahead_and_advance_it_on_the_device(monkeypatch):
    """decode_ids (a captured decode step's routing): the tokens the trace draws, token after token, a step's rows
    at a time, picked by a device counter the call itself advances; wrapping around past the table's end."""
    from flashnext.cache import routing_trace

    monkeypatch.setattr(routing_trace, "DECODE_TABLE_TOKENS", 7)
    routing = CalibratedRouting(16, 3, seed=2)
    expected = CalibratedRouting(16, 3, seed=2).ids(7, "cpu")
    steps = [routing.decode_ids(n, "cpu") for n in (2, 1, 2, 4)]   # batch sizes change: one token stream
    assert [s.shape for s in steps] == [(2, 3), (1, 3), (2, 3), (4, 3)]
    assert torch.equal(torch.cat(steps[:3]), expected[:5])
    assert torch.equal(steps[3], torch.cat([expected[5:], expected[:2]]))    # wraps around
    table, position, _ = routing.decode_table
    assert position.item() == 9 and table.shape == (7, 3)
    # a router in a decode step takes them, with its own softmax weights
    router = Router.__new__(Router)
    torch.nn.Module.__init__(router)
    router.top_k, router.normalize, router.trace = 3, False, routing
    logits = torch.randn(2, 16)
    weights, ids = router.select(logits, decode=True)
    assert torch.equal(ids, expected[2:4])   # position 9 of 7
    torch.testing.assert_close(weights, torch.softmax(logits, -1).gather(1, ids))
