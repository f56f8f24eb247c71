"""Decode ahead (LLMEngine.step, --decode-ahead): the next decode step is queued on the device, fed the tokens the
step before sampled there, before the host reads them. Everything a request gets must equal stepping one step at
a time: tokens (greedy, seeded with penalties, log-probabilities), requests that end while a step ahead runs
(stop token, stop string, abort), a follow-up turn resumed from the snapshot taken at such an end, and the pools
afterwards. On a CPU the fixed-shape decode runner runs uncaptured (engine/cuda_graph.py), so the same code path
runs here as on a GPU, without the overlap."""
import pytest
import torch

from flashnext.engine.args import EngineArgs
from flashnext.engine.cuda_graph import DecodeGraphs
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.sampling_params import SamplingParams
from test_engine import hooked_steps


def engine_with_graphs(model="tiny-flash-next", decode_ahead=True, **args):
    engine = LLMEngine(EngineArgs(model=model, device="cpu", dtype="float32", max_num_seqs=5,
                                  max_num_batched_tokens=16, max_model_len=256, decode_ahead=decode_ahead,
                                  **{"enable_prefix_caching": False, **args}))
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, engine.kv, engine.states, max_batch=4,
                                 max_blocks_per_seq=engine.kv.blocks_for(engine.max_model_len))
    launches = []
    run_ahead = runner.run_ahead
    runner.run_ahead = lambda requests, sampled: (launches.append([r.request_id for r in requests]),
                                                  run_ahead(requests, sampled))[1]
    return engine, launches


def run(engine, requests, arrivals=None, abort_at=None):
    """Add requests[i] = (id, prompt, params) before step arrivals[i]; abort abort_at[1] before step abort_at[0];
    → {id: (token ids, text, finish reason, logprobs)}."""
    arrivals = arrivals or [0] * len(requests)
    out = {rid: ([], "", None, []) for rid, _, _ in requests}
    engine.ended_ahead = set()   # requests that ended while a step ahead held them
    step = 0
    while step <= max(arrivals) or engine.has_work():
        for (rid, prompt, params), at in zip(requests, arrivals):
            if at == step:
                engine.add_request(rid, prompt, params)
        ahead = in_flight(engine)
        outputs = [engine.abort(abort_at[1])] if abort_at is not None and abort_at[0] == step else []
        outputs += engine.step()
        ahead |= in_flight(engine)
        engine.ended_ahead |= {o.request_id for o in outputs if o.finished and o.request_id in ahead}
        for o in outputs:
            ids, text, _, logprobs = out[o.request_id]
            assert out[o.request_id][2] is None, f"{o.request_id}: an output after its last"
            out[o.request_id] = (ids + o.token_ids, text + o.text, o.finish_reason,
                                 logprobs + [(lp.token_id, round(lp.logprob, 4)) for lp in o.logprobs or []])
        step += 1
    return out


def in_flight(engine) -> set[str]:
    return {r.request_id for r in engine._in_flight[0]} if engine._in_flight else set()


def prompts(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (k,), generator=g).tolist() for k in (9, 30, 5, 17)[:n]]


@pytest.mark.parametrize("model", ["tiny-flash-next", "tiny-qwen3-next"])
def test_greedy_with_ends_while_a_step_ahead_runs(model):
    """Staggered arrivals, ends by length, by a stop token and by a stop string while the others decode ahead."""
    ps = prompts(4)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _ = engine_with_graphs(model, decode_ahead=False)
    first = run(plain, [(str(i), p, greedy) for i, p in enumerate(ps)])
    stop_token = first["0"][0][6]          # request 0 ends at its 7th token (or sooner, where it comes earlier)
    stop_text = first["2"][1][-8:-4]       # request 2 ends at a string across its last tokens
    requests = [("0", ps[0], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_token])),
                ("1", ps[1], SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True, logprobs=2)),
                ("2", ps[2], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop_text])),
                ("3", ps[3], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))]
    arrivals = [0, 0, 3, 9]
    plain, none = engine_with_graphs(model, decode_ahead=False)
    want = run(plain, requests, arrivals)
    engine, launches = engine_with_graphs(model)
    free = (engine.kv.num_free, engine.states.num_free)
    got = run(engine, requests, arrivals)
    assert got == want and engine.generation_tokens_total == plain.generation_tokens_total   # dropped rows count not
    assert not none and len(launches) > 10
    assert want["0"][2] == "stop" and want["2"][2] == "stop" and want["1"][3]
    assert {"0", "2"} <= engine.ended_ahead     # the stops came while a step ahead held them: its rows dropped
    assert (engine.kv.num_free, engine.states.num_free) == free and not engine.requests


def test_steps_ahead_while_a_request_waits_for_a_free_slot():
    """A request that cannot be admitted (every sequence slot taken) does not hold the running ones back; once a slot
    frees it is admitted as stepping one at a time admits it."""
    ps = prompts(4) + [[7, 8, 9, 10, 11, 12]]
    requests = [(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                for i, (p, n) in enumerate(zip(ps, (6, 20, 20, 20, 12)))]
    want = run(engine_with_graphs(decode_ahead=False)[0], requests)
    engine, launches = engine_with_graphs()
    assert engine.states.num_free == 4     # one of the five slots is the decode graphs' scratch row
    got = run(engine, requests)
    assert got == want
    waited = [ids for ids in launches if "4" not in ids and len(ids) == 4]   # ahead of the four, "4" waiting
    assert waited and any({"1", "4"} <= set(ids) for ids in launches)   # admitted while the others still ran


def test_seeded_sampling_with_penalties_equals_stepping_one_at_a_time():
    ps = prompts(3)
    params = [SamplingParams(temperature=0.9, top_k=40, seed=5, repetition_penalty=1.3, presence_penalty=0.4,
                             frequency_penalty=0.2, min_tokens=12, max_tokens=20, logit_bias={7: 3.0}),
              SamplingParams(temperature=0.7, top_p=0.9, seed=9, frequency_penalty=0.5, max_tokens=16),
              SamplingParams(temperature=1.1, min_p=0.05, seed=1, max_tokens=22, logprobs=3)]
    requests = [(str(i), p, sp) for i, (p, sp) in enumerate(zip(ps, params))]
    want = run(engine_with_graphs(decode_ahead=False)[0], requests, [0, 2, 2])
    engine, launches = engine_with_graphs()
    assert run(engine, requests, [0, 2, 2]) == want and launches


def test_abort_while_a_step_ahead_runs():
    ps = prompts(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    requests = [(str(i), p, greedy) for i, p in enumerate(ps)]
    want = run(engine_with_graphs(decode_ahead=False)[0], requests, abort_at=(8, "1"))
    engine, launches = engine_with_graphs()
    free = (engine.kv.num_free, engine.states.num_free)
    got = run(engine, requests, abort_at=(8, "1"))
    assert got == want and got["1"][2] == "abort" and "1" in engine.ended_ahead
    assert (engine.kv.num_free, engine.states.num_free) == free and launches


@pytest.mark.parametrize("model", ["tiny-flash-next", "tiny-qwen3-next"])
def test_next_turn_resumes_exactly_from_a_reply_that_ended_ahead(model):
    """A reply that ends by a stop token while its next step runs ahead: that step computed the reply's last token,
    so the prefix cache's snapshot at the end covers the whole reply, and the next turn resumes from it exactly."""
    prompt = prompts(2)[1]
    probe = run(engine_with_graphs(model, decode_ahead=False)[0],
                [("t", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))])
    stop = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[probe["t"][0][9]])
    engine, launches = engine_with_graphs(model, enable_prefix_caching=True, prefix_snapshot_interval=0)
    reply = run(engine, [("turn1", prompt, stop)])["turn1"][0]
    assert reply[-1] == probe["t"][0][9] and engine.ended_ahead == {"turn1"}
    follow = prompt + reply + [11, 12, 13, 14, 15]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("turn2", follow, greedy)
    got, cached = [], None
    while engine.has_work():
        for o in engine.step():
            got += o.token_ids
            cached = o.cached_tokens
    assert cached == len(prompt) + len(reply)       # the whole reply, its last token included
    cold = run(engine_with_graphs(model, decode_ahead=False)[0], [("cold", follow, greedy)])["cold"][0]
    assert got == cold


def test_launched_hook_comes_after_the_step_ahead_is_queued():
    """With a step in flight the server's delivery runs once the next step ahead is queued (the GPU has two)."""
    engine, _ = engine_with_graphs()
    events = []
    runner = engine.runner
    run_ahead = runner.run_ahead
    runner.run_ahead = lambda *a: (events.append("ahead"), run_ahead(*a))[1]
    steps = hooked_steps(engine, events, max_tokens=6)
    assert steps[0] == ["launched"]              # the prompt: eager (no decode step of its width exists yet)
    assert steps[1] == ["launched", "ahead"]     # the first decode: the hook after the graph, then the step ahead
    assert steps[2] == ["ahead", "launched"]     # from the step in flight: the next one ahead first, then the hook
    # six tokens, then the step queued ahead of the last one (its row dropped: the request reached max_tokens)
    assert steps[-1] == ["launched"] and len(steps) == 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on a CPU the copies are the tensors themselves")
def test_tokens_on_host_are_those_of_their_step_not_of_work_queued_after():
    from flashnext.engine.sampled_on_host import SampledOnHost
    from flashnext.engine.sampler import SamplerOutput

    tokens = torch.arange(8, device="cuda")
    logprobs = torch.linspace(-1, 0, 8, device="cuda")
    on_host = SampledOnHost(SamplerOutput(tokens, logprobs))
    torch.cuda._sleep(10_000_000)          # a step queued behind, still running when the host reads
    tokens.add_(100)
    logprobs.zero_()
    ids, lps, top = on_host.lists()
    assert ids == list(range(8)) and lps == torch.linspace(-1, 0, 8).tolist() and top is None


def test_async_engine_streams_and_aborts_with_steps_ahead():
    """Through AsyncLLM (the server's engine thread): streams equal stepping one at a time, and a client that stops
    reading mid-stream (abort between steps, a step ahead in flight) frees its slot and blocks."""
    import asyncio
    import time

    from flashnext.engine.async_llm import AsyncLLM

    ps = prompts(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = run(engine_with_graphs(decode_ahead=False)[0], [(str(i), p, greedy) for i, p in enumerate(ps)])
    engine, launches = engine_with_graphs()
    free = (engine.kv.num_free, engine.states.num_free)
    llm = AsyncLLM(engine)

    async def stream(i, stop_after=None):
        tokens = []
        async for out in llm.generate(ps[i], greedy, request_id=str(i)):
            tokens += out.token_ids
            if stop_after is not None and len(tokens) >= stop_after:
                break   # the client goes away: generate's finally aborts the request
        return tokens

    async def main():
        return await asyncio.gather(stream(0), stream(1, stop_after=5), stream(2))

    try:
        got = asyncio.run(main())
        deadline = time.monotonic() + 30
        while (engine.has_work() or engine.requests) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        llm.shutdown()
    assert got[0] == want["0"][0] and got[2] == want["2"][0]
    assert got[1] == want["1"][0][:len(got[1])] and 5 <= len(got[1]) < 24
    assert launches and (engine.kv.num_free, engine.states.num_free) == free and not engine.requests
