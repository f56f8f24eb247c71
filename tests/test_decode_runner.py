"""The engine with the fixed-shape decode runner (engine/cuda_graph.py; on a CPU it runs without capturing)
gives the same greedy tokens as the eager runner, with requests arriving while others decode, so steps mix
prefill chunks (eager) with decodes (fixed-shape) and the batch buckets pad with scratch rows."""
import pytest
import torch

from flashnext.engine.args import EngineArgs
from flashnext.engine.cuda_graph import DecodeGraphs
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.sampler import SamplingBatch
from flashnext.engine.sampling_params import SamplingParams


def _run(engine, prompts, arrivals, max_tokens=24):
    """Add prompt i before step arrivals[i]; step until done; tokens per request."""
    out, step = {str(i): [] for i in range(len(prompts))}, 0
    while step <= max(arrivals) or engine.has_work():
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(str(i), prompts[i], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                       ignore_eos=True))
        for o in engine.step():
            out[o.request_id] += o.token_ids
        step += 1
    return out


@pytest.mark.parametrize("model", ["tiny-flash-next", "tiny-qwen3-next"])
def test_fixed_shape_runner_equals_eager(model):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (9, 30, 5, 17, 2)]
    arrivals = [0, 0, 3, 7, 8]      # later requests prefill while the first ones decode
    args = dict(model=model, device="cpu", dtype="float32", max_num_seqs=6, enable_prefix_caching=False,
                max_num_batched_tokens=16)
    want = _run(LLMEngine(EngineArgs(**args)), prompts, arrivals)
    engine = LLMEngine(EngineArgs(**args))
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, engine.kv, engine.states, max_batch=5,
                                 max_blocks_per_seq=engine.kv.blocks_for(engine.max_model_len))
    seen_mixed = []
    original = runner._graph_chunks

    def spy(chunks):
        decoding = original(chunks)
        seen_mixed.append(bool(decoding) and len(decoding) < len(chunks))
        return decoding

    runner._graph_chunks = spy
    got = _run(engine, prompts, arrivals)
    assert got == want
    assert any(seen_mixed), "no step mixed prefill chunks with fixed-shape decodes"
    assert {size for size, _ in runner.graphs.graphs} >= {1, 2, 4}   # several buckets, padded rows included
    runner.graphs.release()   # what a rank does before leaving its NCCL group: later steps still run, uncaptured
    assert _run(engine, prompts, arrivals) == want and runner.graphs.graphs   # the buckets came back


def test_advanced_sampling_batch_equals_rebuilt():
    """The runner advances last step's sampling batch on the device when the same requests sample again; with
    penalties, min_tokens, logit bias and seeds that gives the tokens a rebuild every step gives."""
    from flashnext.engine.llm import LLM

    params = [SamplingParams(temperature=0.9, top_k=40, seed=5, repetition_penalty=1.3, presence_penalty=0.4,
                             frequency_penalty=0.2, min_tokens=12, max_tokens=20, logit_bias={7: 3.0}),
              SamplingParams(temperature=0.7, top_p=0.9, seed=9, frequency_penalty=0.5, max_tokens=16)]
    prompts = [[5, 6, 7, 8], [30, 31]]
    llm = LLM("tiny-flash-next", device="cpu", dtype="float32", enable_prefix_caching=False)
    builds = []
    build = SamplingBatch.build
    SamplingBatch.build = classmethod(lambda cls, *a, **k: builds.append(1) or build(*a, **k))
    try:
        advanced = [c.token_ids for c in llm.generate(prompts, params)]
    finally:
        SamplingBatch.build = build
    assert len(builds) <= 3                    # built when the batch changed, advanced on the device otherwise
    runner, rebuilds = llm.engine.runner, []
    original = runner._sampling_batch

    def rebuilt(requests, appendable):
        runner._last_batch = None
        rebuilds.append(1)
        return original(requests, False)

    runner._sampling_batch = rebuilt
    assert [c.token_ids for c in llm.generate(prompts, params)] == advanced
    assert len(rebuilds) > 10


def conversation_turns(engine, history, params, new_messages):
    """One chat's turns: each prompt is the last one, its reply, the next new message (history_len there) and a
    generation prompt of 2–4 tokens → [(reply tokens, cached tokens)] per turn."""
    prompt, hist, turns = history + [7, 8, 9, 10, 11], len(history), []
    for turn, message in enumerate(new_messages):
        request = engine.add_request(f"t{turn}", prompt, params, history_len=hist)
        tokens = []
        while engine.has_work():
            for o in engine.step():
                tokens += o.token_ids
        turns.append((tokens, request.num_cached))
        hist = len(prompt) + len(tokens) + len(message)
        prompt = prompt + tokens + message + [7, 8, 9, 10, 11][: 2 + turn]
    return turns


def follow_up_conversation(seed: int = 5, sizes=(9, 13, 17)):
    """A tiny Flash-Next CPU engine's arguments and a conversation over them: a 40-token history, then new messages
    of `sizes` tokens, greedy replies of 6 tokens → (EngineArgs keywords, run(engine) → conversation_turns')."""
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(3, 400, (40,), generator=g).tolist()
    messages = [torch.randint(3, 400, (n,), generator=g).tolist() for n in sizes]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    args = dict(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                decode_ahead=False)
    return args, lambda engine: conversation_turns(engine, history, params, messages)


def test_prompt_tail_fed_one_token_a_step_through_the_decode_graph():
    """Scheduler.graph_tail: a prompt chunk of at most that many tokens (an agent turn's generation prompt after
    the history cut; a short remainder after a prefix hit) goes one token a step through the fixed-shape runner,
    rows that do not sample included; the tokens equal the eager engine's, the prefix cache hits alike."""
    g = torch.Generator().manual_seed(5)
    history = torch.randint(3, 400, (40,), generator=g).tolist()
    args = dict(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    conversation = lambda engine: conversation_turns(engine, history, params, [[12, 13, 14]] * 3)  # noqa: E731

    want = conversation(LLMEngine(EngineArgs(**args)))
    # decode ahead off: with it a reply's end snapshot also covers its last token, one more cached next turn
    # (tests/test_decode_ahead.py)
    engine = LLMEngine(EngineArgs(**args, decode_ahead=False))
    assert engine.scheduler.graph_tail == 0          # no decode graphs on a CPU engine: no token-by-token tail
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, engine.kv, engine.states, max_batch=4,
                                 max_blocks_per_seq=engine.kv.blocks_for(engine.max_model_len))
    engine.scheduler.graph_tail = 16
    replayed_prompt_tokens = []
    original = runner._replay

    def spy(requests, *rest):   # rows that feed a prompt token, not the last: they do not sample
        replayed_prompt_tokens.extend(r for r in requests if r.num_computed + 1 < r.num_tokens)
        return original(requests, *rest)

    runner._replay = spy
    got = conversation(engine)
    assert got == want
    assert all(cached > 0 for _, cached in got[1:])
    assert len(replayed_prompt_tokens) >= 3 * 4       # each turn's tail but its sampled last token
    # a short prompt that starts a sequence runs eagerly: the decode step never clears a slot's old states
    fresh = engine.add_request("fresh", [5, 6, 7, 8, 9, 10], params)
    assert engine.scheduler._chunk_len(fresh, 0, 32) == 6 and engine.scheduler._chunk_len(fresh, 2, 32) == 1
    # nor does a sequence's first token when the budget leaves one (several GPUs: the workers clear a slot only
    # for an eager chunk that starts a sequence)
    from flashnext.engine.scheduler import ScheduledChunk

    assert runner._graph_chunks([ScheduledChunk(fresh, 1)]) == []


def test_prompt_tail_beside_a_prompt_that_samples_eagerly():
    """A step whose one-token chunks all feed prompt tails (nothing to sample from the graph) beside an eager
    prompt that samples — and a fresh short prompt, which runs eagerly — gives the eager engine's tokens."""
    args = dict(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def run(engine):
        out = {"a": [], "b": []}
        engine.add_request("a", list(range(3, 48)), params, history_len=40)
        engine.step()
        engine.add_request("b", [5, 6, 7, 8, 9, 10], params)
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.token_ids
        return out

    want = run(LLMEngine(EngineArgs(**args)))
    engine = LLMEngine(EngineArgs(**args))
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, engine.kv, engine.states, max_batch=4,
                                 max_blocks_per_seq=engine.kv.blocks_for(engine.max_model_len))
    engine.scheduler.graph_tail = 16
    assert run(engine) == want
