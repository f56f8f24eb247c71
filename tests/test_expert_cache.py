"""Expert cache (--expert-vram-gb): at any slot budget, down to top-k slots per layer, the model's outputs are
bit-identical to all experts resident (fp32, CPU); the counters add up; lfu-decay beats LRU on a hot set + scans."""
import random

import pytest
import torch

from flashnext.cache.expert_cache import install_expert_cache
from flashnext.cache.expert_trace import replay
from flashnext.engine.args import EngineArgs
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.loading import load_model
from flashnext.engine.sampling_params import SamplingParams
from flashnext.models.layers.int4_experts import Int4Experts
from flashnext.models.session import Session
from flashnext.server.metrics import ServerMetrics, expert_cache_of

PRESETS = ["tiny-flash-next", "tiny-qwen3-next"]   # 8 experts, top-2, 4 layers


def _prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 480) for _ in range(n)]


def _greedy(model, prompt, n=6):
    """Logits of the prompt (every position) and of n greedy decode steps."""
    s = Session(model, 128)
    logits = [s.extend(prompt, all_logits=True)]
    for _ in range(n):
        logits.append(s.extend([int(logits[-1][-1].argmax())])[None])
    return torch.cat(logits)


def _three_greedy(engine, max_tokens):
    """Three 30-token prompts decoded together greedily → {request id: tokens}."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), _prompt(30, seed=i), params)
    out = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


@pytest.fixture(scope="module", params=PRESETS)
def resident(request):
    return request.param, _greedy(load_model(request.param, "cpu", torch.float32, quantize="int4").model, _prompt(41))


@pytest.mark.parametrize("slots", [2, 3, 5, 8])           # 2 = top-k (the minimum), 8 = every expert
@pytest.mark.parametrize("policy,prefetch", [("lfu-decay", True), ("lru", True), ("lfu-decay", False)])
def test_outputs_equal_all_resident(resident, slots, policy, prefetch):
    name, want = resident
    model = load_model(name, "cpu", torch.float32, quantize="int4").model
    cache = install_expert_cache(model, policy=policy, slots_per_layer=slots, prefetch=prefetch)
    reads = []
    for experts in (m for m in model.modules() if isinstance(m, Int4Experts)):   # forward(x, weights, ids)
        experts.register_forward_hook(lambda mod, args, out: reads.append(args[2].unique().numel()))
    assert torch.equal(_greedy(model, _prompt(41)), want)
    st = cache.stats
    assert st.hits + st.misses == sum(reads) and st.misses >= 1
    assert st.bytes_copied == (st.misses + st.prefetched) * cache.layers[0].bytes_per_expert
    assert 0 <= st.prefetch_used <= st.prefetched
    # one decoded token guesses top-k = 2 experts per next layer: prefetch runs when that is at most half a pool
    assert (st.prefetched > 0) == (prefetch and 4 <= slots < 8)            # 8: every expert resident already
    assert slots < 8 or st.misses + st.prefetched == 8 * len(cache.layers)   # all fit: each copied in once


def test_budget_in_gib_and_minimum():
    model = load_model("tiny-flash-next", "cpu", torch.float32, quantize="int4").model
    per_layer_expert = sum(b[0].numel() * b.element_size()
                           for b in next(m for m in model.modules() if hasattr(m, "expert_cache")).buffers(recurse=False))
    with pytest.raises(ValueError, match="at least 2 slots per layer"):
        install_expert_cache(model, budget_bytes=2 * 4 * per_layer_expert - 1)
    cache = install_expert_cache(model, budget_bytes=3 * 4 * per_layer_expert + 7)
    assert cache.slots_per_layer == 3 and cache.device_bytes == 3 * 4 * per_layer_expert


def test_needs_int4_experts():
    model = load_model("tiny-flash-next", "cpu", torch.float32).model
    with pytest.raises(ValueError, match="--quantize int4"):
        install_expert_cache(model, budget_bytes=1 << 30)
    with pytest.raises(ValueError, match="--expert-cache-policy"):
        install_expert_cache(load_model("tiny-flash-next", "cpu", torch.float32, quantize="int4").model,
                             1 << 30, policy="fifo")


def test_engine_outputs_and_metrics():
    run = lambda engine: _three_greedy(engine, 8)  # noqa: E731
    args = EngineArgs(model="tiny-qwen3-next", device="cpu", dtype="float32", quantize="int4", max_num_seqs=4,
                      max_num_batched_tokens=23, max_model_len=256, expert_vram_gb=1e-9)
    with pytest.raises(ValueError, match="expert slots per layer"):
        load_model(args.model, "cpu", torch.float32, quantize="int4", expert_vram_gb=1e-9)
    want = run(LLMEngine(EngineArgs(**{**vars(args), "expert_vram_gb": None})))
    loaded = load_model(args.model, "cpu", torch.float32, quantize="int4", expert_vram_gb=4e-5)  # 3 slots of 3,328 bytes × 4 layers
    engine = LLMEngine(args, loaded)
    assert 2 <= loaded.expert_cache.slots_per_layer < 8
    assert run(engine) == want
    settings = type("S", (), {"served_model_name": "m"})()
    text = ServerMetrics(settings, lambda: engine).render()[0].decode()
    st = expert_cache_of(engine).stats
    for name, value in (("hits", st.hits), ("misses", st.misses), ("bytes_copied", st.bytes_copied)):
        assert f'flashnext_expert_cache_{name}_total{{model_name="m"}} {float(value)}' in text


def _hot_and_scans(steps=3000, num_experts=64, hot=12, top_k=4, seed=0):
    """Each step needs top_k experts of a stable hot set; every 50 steps a scan reads 32 cold experts once."""
    rng = random.Random(seed)
    trace = []
    for t in range(steps):
        if t % 50 == 0:
            cold = rng.sample(range(hot, num_experts), 32)
            trace += [cold[i:i + top_k] for i in range(0, 32, top_k)]
        trace.append(rng.sample(range(hot), top_k))
    return trace


def test_lfu_decay_beats_lru_on_hot_set_with_scans():
    trace = _hot_and_scans()
    lfu, lru = (replay(trace, 64, 16, policy) for policy in ("lfu-decay", "lru"))
    assert sum(lfu) == sum(lru) == sum(len(s) for s in trace)
    cold = 60 * 32                         # scan reads: misses under any policy
    assert lfu[1] < cold + 100, lfu        # the hot set survives the scans (misses ≈ warm-up + scans only)
    assert lru[1] > cold + 500, lru        # LRU lets every scan flush part of the hot set


def test_replay_pins_the_step():
    with pytest.raises(ValueError, match="needs 3 experts"):
        replay([[0, 1, 2]], 8, 2)
    assert replay([[0, 1], [2, 3], [0, 1]], 8, 4) == (2, 4)


def test_optimal_replay_evicts_what_is_needed_last_and_bounds_every_policy():
    from flashnext.cache.expert_trace import replay_optimal

    # two slots: for 2, LRU evicts 1 (the least recent) and misses it next; knowing 0 is not needed again, keep 1
    trace = [[0], [1], [0], [2], [1]]
    assert replay(trace, 4, 2, "lru") == (1, 4)
    assert replay_optimal(trace, 4, 2) == (2, 3)
    with pytest.raises(ValueError, match="needs 3 experts"):
        replay_optimal([[0, 1, 2]], 8, 2)
    trace = _hot_and_scans(steps=300)
    best = replay_optimal(trace, 64, 16)
    assert sum(best) == sum(len(s) for s in trace)
    assert all(best[0] >= replay(trace, 64, 16, policy)[0] for policy in ("lfu-decay", "lru"))


@pytest.mark.parametrize("checkpoint", ["int4", "bf16"])
def test_load_with_budget_keeps_experts_in_host_memory(checkpoint, tmp_path):
    """load_model with --expert-vram-gb reads the experts into host memory (an INT4 checkpoint's codes as they
    are; a 16-bit one quantised chunk by chunk), so the model never has to fit the device whole; outputs equal
    the same checkpoint loaded all-resident."""
    from flashnext.models.layers.int4_experts import Int4Experts
    from flashnext.weights.synth import synthesize

    folder = str(synthesize("tiny-flash-next", tmp_path / "ckpt", dtype=checkpoint, seed=2))
    quantize = "int4" if checkpoint == "bf16" else None
    resident = load_model(folder, "cpu", torch.float32, quantize=quantize).model
    sets = [m for m in resident.modules() if isinstance(m, Int4Experts)]
    per_expert = sum(b[0].numel() * b.element_size() for b in sets[0].buffers(recurse=False))
    loaded = load_model(folder, "cpu", torch.float32, quantize=quantize,
                        expert_vram_gb=3 * len(sets) * per_expert / 2**30)
    assert loaded.expert_cache.slots_per_layer == 3
    for layer in loaded.expert_cache.layers:
        assert layer.host["gate_up_qweight"].device.type == "cpu"
    want = {n: m.weight_int4("gate_up").qweight for n, m in resident.named_modules() if isinstance(m, Int4Experts)}
    for name, module in loaded.model.named_modules():
        if isinstance(module, Int4Experts):
            assert torch.equal(module.expert_cache.host["gate_up_qweight"], want[name])   # the same codes
    assert torch.equal(_greedy(loaded.model, _prompt(41)), _greedy(resident, _prompt(41)))


def _graph_step_engine(model: str):
    """An engine on the CPU whose decode runs the fixed-shape graph step (uncaptured here) with an expert cache of 3
    of 8 slots a layer and its ClaimPool hooked in → (run: three greedy requests, their all-resident tokens, the
    engine, the cache, the ClaimPool)."""
    from flashnext.engine.cuda_graph import DecodeGraphs

    run = lambda engine: _three_greedy(engine, 12)  # noqa: E731
    args = EngineArgs(model=model, device="cpu", dtype="float32", quantize="int4", max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=256, enable_prefix_caching=False)
    want = run(LLMEngine(args))
    loaded = load_model(model, "cpu", torch.float32, quantize="int4", expert_vram_gb=4e-5)   # 3 of 8 slots a layer
    engine = LLMEngine(EngineArgs(**{**vars(args), "expert_vram_gb": 4e-5}), loaded)
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, engine.kv, engine.states, max_batch=4,
                                 max_blocks_per_seq=engine.kv.blocks_for(engine.max_model_len))
    pool = loaded.expert_cache.enable_graphs()
    runner.graphs.keeper = pool
    return run, want, engine, loaded.expert_cache, pool


@pytest.mark.parametrize("model", PRESETS)
def test_pools_admitting_inside_the_graph_step_keep_outputs_exact(model):
    """The decode graph's path (cache/expert_claim_pool.py; on a CPU the fixed-shape step runs uncaptured): each
    decode claims slots for its missed experts (LRU) and the MoE writes them there as it reads them — outputs equal
    all-resident, experts were admitted, the counters add up, and after settling every resident slot holds its
    expert's words, no slot twice, none free; an eager prefill in between keeps working on the settled pools."""
    run, want, engine, cache, pool = _graph_step_engine(model)
    assert all(not layer.free for layer in cache.layers)          # filled from the start

    def consistent():
        pool.settle()
        for layer in cache.layers:
            assert torch.equal(layer.slot_table, layer.slot_of) and not layer.free
            resident = layer.slot_of[layer.slot_of >= 0]
            assert sorted(resident.tolist()) == list(range(layer.num_slots))
            for expert in (layer.slot_of >= 0).nonzero().flatten().tolist():   # each slot holds its expert's words
                slot = layer.slot_of[expert].item()
                assert all(torch.equal(getattr(layer.module, n)[slot], layer.host[n][expert]) for n in layer.names)

    assert run(engine) == want
    assert run(engine) == want                                     # prefills (eager) after graph steps, settled
    consistent()
    st = cache.stats
    admitted = int(pool.counts[:, 2].sum())
    assert admitted > 0 and st.admitted == admitted
    assert int(pool.counts[:, :2].sum()) > 0 and st.hits + st.misses >= int(pool.counts[:, :2].sum())
    # a replayed step: the keeper is told, the recorded claim programs run, no Python `routed` — settle still
    # takes the device's tables back
    from flashnext.ops.expert_claims import claim_slots

    layer = cache.layers[0]
    pool.before_step(1)
    claim_slots(layer.slot_table, pool.last_used[0], pool.clock[0], pool.counts[0],
                (layer.slot_of < 0).nonzero()[:2].T, None)
    pool.after_step()
    assert not torch.equal(layer.slot_table, layer.slot_of)
    write = torch.where(layer.slot_table <= -2, -layer.slot_table - 2, -1)    # what that step's kernels wrote
    for expert in (write >= 0).nonzero().flatten().tolist():
        for n in layer.names:
            getattr(layer.module, n)[write[expert]] = layer.host[n][expert]
    consistent()
    assert run(engine) == want
