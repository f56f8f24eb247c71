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
