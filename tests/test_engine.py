"""The engine: batched, chunked scheduling gives exactly what each request gets alone; aborts and
preemption leave the pools as they started; impossible requests are refused with the limit named."""
import random

import pytest

from flashnext.engine.args import EngineArgs
from flashnext.engine.errors import RequestRejected
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.sampling_params import SamplingParams
from flashnext.models.session import Session

PRESETS = ["tiny-flash-next", "tiny-qwen3-next", "tiny-qwen3.5-moe"]


@pytest.fixture(scope="module", params=PRESETS)
def engine(request):
    return LLMEngine(EngineArgs(model=request.param, device="cpu", dtype="float32", max_num_seqs=6,
                                max_num_batched_tokens=23, max_model_len=512))


def greedy_alone(engine, prompt, n):
    return Session(engine.loaded.model, 512).greedy(prompt, n)


def run_all(engine, max_steps=10_000):
    outputs = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_work()
    return outputs


def pools_idle(engine):
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()      # cached prefixes hold blocks on purpose
    assert engine.kv.num_free == engine.kv.num_blocks
    assert all(c == 0 for c in engine.kv.refcount)
    assert engine.states.num_free == engine.states.num_slots
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests


def test_batched_chunked_equals_alone(engine):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 480) for _ in range(n)] for n in (5, 70, 1, 33, 120, 17, 64, 9)]
    max_tokens = [12, 5, 20, 9, 3, 16, 7, 11]
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
    outputs = run_all(engine)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        got = [t for o in outputs[str(i)] for t in o.token_ids]
        assert got == greedy_alone(engine, p, m), f"request {i}"
        assert outputs[str(i)][-1].finish_reason == "length"
        assert outputs[str(i)][-1].completion_tokens == m
    pools_idle(engine)


def second_arrives_while_first_decodes(engine, first, first_tokens, second, arrive_at):
    """Run "first", add "second" (3 tokens) before step arrive_at; → (per step [(request id, tokens, decode?)],
    outputs by request id)."""
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        chunks = schedule()
        steps.append([(c.request.request_id, c.num_tokens, c.request.num_tokens - c.request.num_computed == 1)
                      for c in chunks])
        return chunks

    engine.scheduler.schedule = recording
    engine.add_request("first", first, SamplingParams(max_tokens=first_tokens, temperature=0, ignore_eos=True))
    outputs = {}
    for step in range(300):
        if step == arrive_at:
            engine.add_request("second", second, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
        if not engine.has_work():
            break
    assert outputs["first"] == greedy_alone(engine, first, first_tokens)
    assert outputs["second"] == greedy_alone(engine, second, 3)
    pools_idle(engine)
    return steps, outputs


def test_prefill_budget_shrinks_while_others_decode():
    """A long prompt arriving while another request decodes enters 7 tokens per step (the decodes keep flowing);
    alone it takes the full 40-token budget; outputs equal each request alone."""
    engine = LLMEngine(EngineArgs(model="tiny-qwen3-next", device="cpu", dtype="float32", max_num_seqs=4,
                                  max_num_batched_tokens=40, prefill_budget_while_decoding=7, max_model_len=512))
    rng = random.Random(1)
    first, second = [rng.randrange(3, 480) for _ in range(90)], [rng.randrange(3, 480) for _ in range(60)]
    steps, _ = second_arrives_while_first_decodes(engine, first, 30, second, arrive_at=4)
    assert [n for _, n, _ in steps[0]] == [40]          # alone: the full budget
    mixed = [s for s in steps if any(decode for _, _, decode in s) and any(not d for _, _, d in s)]
    assert mixed and all(sum(n for _, n, decode in s if not decode) <= 7 for s in mixed)
    assert sum(n for s in mixed for rid, n, decode in s if rid == "second" and not decode) >= 50


def test_decode_only_steps_between_prefill_chunks():
    """--decode-steps-between-prefill 3: after each step that carries a prefill chunk beside a decode, three steps of
    decodes alone; the prompt still enters whole and every output equals its request alone."""
    engine = LLMEngine(EngineArgs(model="tiny-qwen3-next", device="cpu", dtype="float32", max_num_seqs=4,
                                  max_num_batched_tokens=40, prefill_budget_while_decoding=7, max_model_len=512,
                                  decode_steps_between_prefill=3))
    rng = random.Random(2)
    first, second = [rng.randrange(3, 480) for _ in range(50)], [rng.randrange(3, 480) for _ in range(40)]
    steps, _ = second_arrives_while_first_decodes(engine, first, 60, second, arrive_at=3)
    prefill = [i for i, s in enumerate(steps) if any(rid == "second" and n > 1 for rid, n, _ in s)]
    assert len(prefill) >= 5                                      # 40 tokens, 7 a step beside the decodes
    for i in prefill[:-1]:
        assert steps[i + 1: i + 4] == [[("first", 1, True)]] * 3  # three decode-only steps after each chunk


def test_schedule_ahead_is_the_decode_step_schedule_would_pick():
    """Scheduler.schedule_ahead (a decode step queued before the last tokens reach the host): every running request
    one token, its KV block reserved when the token starts one, a decode-only step counted like schedule()'s — and
    no step ahead while a waiting request could be admitted, a running one is left out, or the runner says no."""
    engine = LLMEngine(EngineArgs(model="tiny-qwen3-next", device="cpu", dtype="float32", max_num_seqs=2,
                                  max_num_batched_tokens=64, max_model_len=512))
    sched = engine.scheduler
    engine.add_request("a", list(range(3, 34)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while not (sched.running and sched.running[0].output_ids):
        engine.step()
    request = sched.running[0]
    request.num_computed += 1             # as the step in flight computed its token, whose sample is not read yet
    widths = []
    sched._decode_only_steps = 2
    blocks = len(request.blocks)
    chunks = sched.schedule_ahead([request], lambda w: widths.append(w) or True)
    assert [(c.request, c.num_tokens) for c in chunks] == [(request, 1)] and sched._decode_only_steps == 1
    assert len(request.blocks) == engine.kv.blocks_for(request.num_computed + 1) >= blocks
    assert widths == [len(request.blocks)]
    assert sched.schedule_ahead([request], lambda w: False) is None    # the runner cannot
    assert sched.schedule_ahead([], lambda w: True) is None             # one left out
    engine.add_request("b", [7, 8, 9], SamplingParams(max_tokens=2))                          # one could be admitted
    assert sched.schedule_ahead([request], lambda w: True) is None


def test_warm_up_leaves_no_trace():
    """Serving warms up with throwaway requests: afterwards the counters, the prefix cache and the pools are as
    before, and a request gives what it gives alone."""
    engine = LLMEngine(EngineArgs(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=4,
                                  max_num_batched_tokens=23, max_model_len=512))
    before = engine.stats()
    assert engine.warm_up() > 0
    assert engine.stats() == before and engine.prefix_cache.num_snapshots == 0
    pools_idle(engine)
    engine.add_request("r", [7, 8, 9, 10], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    got = [t for o in run_all(engine)["r"] for t in o.token_ids]
    assert got == greedy_alone(engine, [7, 8, 9, 10], 6)


def test_warm_up_prepares_one_sequence_at_every_width():
    """With decode graphs on one GPU, the warm-up also prepares batch 1's step at every block-table width (on a
    CPU the buckets are recorded uncaptured), so a long conversation's first tokens wait for no capture."""
    from flashnext.engine.cuda_graph import MIN_WIDTH, DecodeGraphs

    engine = LLMEngine(EngineArgs(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=2,
                                  max_num_batched_tokens=32, max_model_len=1024))
    graphs = DecodeGraphs(engine.runner.model, engine.kv, engine.states, 2, engine.kv.blocks_for(1024))
    engine.runner.graphs = graphs
    engine.warm_up()
    widths = {w for size, w in graphs.graphs if size == 1}
    assert widths == {MIN_WIDTH << i for i in range((graphs.max_width // MIN_WIDTH).bit_length())}
    assert graphs.capture_widths(1) == 0             # nothing left to capture


def test_warm_up_captures_every_row_graph_bucket():
    """With row-wise prefill graphs (engine/row_graphs.py; on a CPU recorded uncaptured) the warm-up runs a prompt of
    every bucket's size and two of half its size in one step (the plans of one sequence and of several), so no
    request's step captures; the engine's counters and cache are as before."""
    from flashnext.engine.row_graphs import RowGraphs, buckets_up_to

    engine = LLMEngine(EngineArgs(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=2,
                                  max_num_batched_tokens=256, max_model_len=1024))
    engine.runner.row_graphs = RowGraphs("cpu", 256)
    before = engine.stats()
    engine.warm_up()
    assert set(engine.runner.row_graphs.plans) == {(size, single) for size in buckets_up_to(256)
                                                   for single in (True, False)} == {
        (64, True), (128, True), (256, True), (64, False), (128, False), (256, False)}
    assert all(plan.captured for plan in engine.runner.row_graphs.plans.values())
    assert engine.stats() == before and engine.prefix_cache.num_snapshots == 0


def test_same_seed_same_text(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("noise", [9, 9, 9, 9], SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True))
    first = run_all(engine)["a"]
    engine.add_request("b", [5, 6, 7], params)
    second = run_all(engine)["b"]
    ids = lambda outs: [t for o in outs for t in o.token_ids]  # noqa: E731
    assert ids(first) == ids(second)
    assert "".join(o.text for o in first) == "".join(o.text for o in second)


def test_stop_string_across_tokens(engine):
    prompt = [11, 12, 13, 14]
    engine.add_request("free", prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    text = "".join(o.text for o in run_all(engine)["free"])
    assert len(text) >= 6
    stop = text[3:6]                      # three characters, usually spanning a token boundary
    engine.add_request("stopped", prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))
    outs = run_all(engine)["stopped"]
    assert "".join(o.text for o in outs) == text[: text.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    pools_idle(engine)


def test_random_aborts_leave_pools_as_they_started():
    # Pool bookkeeping does not depend on the architecture: one preset, short requests, many of them.
    engine = LLMEngine(EngineArgs(model="tiny-qwen3.5-moe", device="cpu", dtype="float32", max_num_seqs=16,
                                  max_num_batched_tokens=128, max_model_len=512))
    rng = random.Random(1)
    live = []
    for i in range(1000):
        prompt = [rng.randrange(3, 480) for _ in range(rng.randrange(1, 12))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 4), temperature=0.7))
        live.append(f"r{i}")
        if rng.random() < 0.3:
            engine.abort(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.1:
            engine.step()
    while engine.has_work():
        if rng.random() < 0.05 and engine.requests:
            engine.abort(rng.choice(list(engine.requests)))
        engine.step()
    pools_idle(engine)


def test_preemption_keeps_outputs_exact():
    # Too few KV blocks for all requests at once: the scheduler must preempt and recompute.
    engine = LLMEngine(EngineArgs(model="tiny-qwen3-next", device="cpu", dtype="float32", max_num_seqs=4,
                                  max_num_batched_tokens=64, max_model_len=128, kv_cache_gb=12 * 16 * 4 * 2 * 32 * 4 / 2**30))
    assert engine.kv.num_blocks < 4 * 6
    prompts = [[7 + i] * 60 for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    outputs = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert [t for o in outputs[str(i)] for t in o.token_ids] == greedy_alone(engine, p, 30)
    pools_idle(engine)


def test_preemption_spills_to_the_host_tier_and_resumes_exactly():
    """With a host-RAM tier, preempted requests' snapshots go down to host RAM when the KV pool runs short, and the
    requests resume from there instead of recomputing — outputs unchanged."""
    engine = LLMEngine(EngineArgs(model="tiny-qwen3-next", device="cpu", dtype="float32", max_num_seqs=4,
                                  max_num_batched_tokens=64, max_model_len=128, kv_host_gb=0.05,
                                  kv_cache_gb=12 * 16 * 4 * 2 * 32 * 4 / 2**30))
    host, loads = engine.prefix_cache.lower, []
    load = host.load
    host.load = lambda key: loads.append(key) or load(key)
    prompts = [[7 + i] * 60 for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    outputs = run_all(engine)
    assert engine.scheduler.num_preemptions > 0 and loads, "preempted requests should come back from host RAM"
    for i, p in enumerate(prompts):
        assert [t for o in outputs[str(i)] for t in o.token_ids] == greedy_alone(engine, p, 30)
    pools_idle(engine)


def test_refusals_name_the_limit(engine):
    with pytest.raises(RequestRejected, match="maximum context length is 512") as e:
        engine.add_request("long", [5] * 500, SamplingParams(max_tokens=20))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.add_request("vocab", [10**6], SamplingParams())
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    pools_idle(engine)


def hooked_steps(engine, events: list, max_tokens: int) -> list[list[str]]:
    """Run one greedy request of 5 prompt tokens to its end; → per step, what `events` recorded (the spies the
    caller installed, and "launched" when the step calls the server's hook)."""
    engine.add_request("hook", [3, 4, 5, 6, 7], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    steps = []
    while engine.has_work():
        events.clear()
        engine.step(launched=lambda: events.append("launched"))
        steps.append(list(events))
    return steps


def test_launched_hook_runs_after_the_decode_graph_and_before_an_eager_forward():
    """The server delivers a step's outputs while the next step computes (AsyncLLM._loop): the runner calls the hook
    right after replaying a decode graph that runs the whole step, before an eager forward (a prefill chunk), and
    the engine at once for an empty step. (The fixed-shape decode runner runs uncaptured on a CPU.)"""
    from flashnext.engine.cuda_graph import DecodeGraphs

    engine = LLMEngine(EngineArgs(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=2,
                                  enable_prefix_caching=False, decode_ahead=False))   # with it: test_decode_ahead
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, engine.kv, engine.states, max_batch=2,
                                 max_blocks_per_seq=engine.kv.blocks_for(engine.max_model_len))
    events = []
    for name in ("_forward_eager", "_sample"):
        original = getattr(runner, name)
        setattr(runner, name, lambda *a, _name=name, _f=original: (events.append(_name), _f(*a))[1])
    graph_run = runner.graphs.run
    runner.graphs.run = lambda *a: (events.append("graph"), graph_run(*a))[1]
    steps = hooked_steps(engine, events, max_tokens=3)
    assert steps[0] == ["launched", "_forward_eager", "_sample"]       # the prompt: eager, the hook first
    assert steps[-1] == ["graph", "launched", "_sample"]               # a decode: the hook once the graph is queued
    events.clear()
    assert engine.step(launched=lambda: events.append("launched")) == [] and events == ["launched"]


def test_finished_requests_log_their_timing(engine, caplog):
    with caplog.at_level("INFO", logger="flashnext.engine"):
        engine.add_request("timed", [3, 4, 5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        run_all(engine)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("timed "))
    assert "timed length: prompt 5 tokens (" in line and "first token" in line and "4 tokens" in line


def test_request_tokens_across_the_prompt_and_output_boundary():
    from flashnext.engine.request import Request

    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), None, 16, output_ids=[7, 8])
    every = r.all_ids
    for start in range(len(every) + 1):
        for stop in range(start, len(every) + 1):
            assert r.tokens(start, stop) == every[start:stop]


def test_the_step_token_budget_follows_the_device(monkeypatch):
    """max_num_batched_tokens left unset: 8,192 on the CPU and on a GPU under 72 GiB, 16,384 from there (80 GB cards
    report ~79.3 GiB; a larger prefill chunk runs faster, its activations' memory planned from this budget)."""
    from types import SimpleNamespace

    import torch

    from flashnext.engine import args as engine_args

    engine = LLMEngine(EngineArgs(model="tiny-flash-next", device="cpu", dtype="float32", max_model_len=512))
    assert engine.args.max_num_batched_tokens == engine.scheduler.token_budget == 8192
    for gib, want in ((24, 8192), (71, 8192), (72, 16384), (79.25, 16384), (141, 16384)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, gib=gib: SimpleNamespace(total_memory=int(gib * 2**30)))
        assert engine_args.step_token_budget("cuda:0") == want, gib
