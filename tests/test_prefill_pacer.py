"""The step-time budget for prefill while others decode: the pacer's arithmetic, and the engine using it (mixed
steps shrink to what the budget allows once it has measured a step of each kind; outputs stay exact)."""
import random

import pytest

from flashnext.engine.args import EngineArgs
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.prefill_pacer import MIN_TOKENS, PrefillPacer
from flashnext.engine.sampling_params import SamplingParams
from flashnext.models.session import Session


def test_pacer_sizes_chunks_from_measured_steps():
    pacer = PrefillPacer(budget_s=0.05, max_tokens=2048)
    assert pacer.tokens() == 2048                          # nothing measured: the fixed budget
    pacer.record(0, 4, 0.010)                              # a decode-only step: 10 ms
    assert pacer.tokens() == 2048
    pacer.record(1000, 4, 0.110)                           # mixed: 100 ms for 1,000 prefill tokens
    assert pacer.tokens() == pytest.approx(400, abs=1)     # (50 − 10) ms at 0.1 ms a token
    pacer.record(0, 4, 0.060)                              # a slower decode step moves the average 30% of the way
    assert pacer.tokens() == pytest.approx(250, abs=1)     # (50 − 25) ms at 0.1 ms a token
    pacer.record(0, 4, 1.0)                                # decodes alone now take longer than the budget
    assert pacer.tokens() == MIN_TOKENS
    pacer.record(500, 0, 9.0)                              # prefill-only steps say nothing about mixed ones
    assert pacer.decode_s == pytest.approx(0.7 * (0.7 * 0.010 + 0.3 * 0.060) + 0.3 * 1.0)


def test_engine_keeps_mixed_steps_within_the_budget():
    engine = LLMEngine(EngineArgs(model="tiny-qwen3-next", device="cpu", dtype="float32", max_num_seqs=4,
                                  max_num_batched_tokens=200, prefill_budget_while_decoding=150,
                                  decode_step_budget_ms=1e-3, max_model_len=512))
    steps, schedule = [], engine.scheduler.schedule

    def recording():
        chunks = schedule()
        steps.append([(c.num_tokens, c.request.num_tokens - c.request.num_computed == 1) for c in chunks])
        return chunks

    engine.scheduler.schedule = recording
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 480) for _ in range(n)] for n in (12, 300, 260)]
    outs = {str(i): [] for i in range(3)}
    engine.add_request("0", prompts[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for step in range(400):
        if step in (5, 6):
            engine.add_request(str(step - 4), prompts[step - 4], SamplingParams(max_tokens=3, temperature=0,
                                                                                ignore_eos=True))
        for o in engine.step():
            outs[o.request_id] += o.token_ids
        if not engine.has_work():
            break
    mixed = [sum(n for n, decode in s if not decode) for s in steps if any(d for _, d in s) and any(not d for _, d in s)]
    # the first mixed step knows no prefill cost yet and takes the fixed 150; then the 1 µs budget leaves the minimum
    assert mixed[0] == 150 and max(mixed[1:]) <= MIN_TOKENS and len(mixed) > 2
    for i, p in enumerate(prompts):
        assert outs[str(i)] == Session(engine.loaded.model, 512).greedy(p, 40 if i == 0 else 3)


def test_steps_with_chained_chunks_are_not_timed():
    """A step that replays chained graph steps (a follow-up turn's short chunks after its prefix hit,
    DecodeGraphs.extend) beside another sequence's decode is neither a decode-only step nor eager prefill at the
    rate the pacer models: the engine records no time for it, and every other step here. (Chained steps run uncaptured
    on a CPU: tests/test_extend.py.)"""
    from test_extend import _chained_engine

    engine = _chained_engine(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=4,
                             max_num_batched_tokens=64, decode_ahead=False, decode_step_budget_ms=50)
    pacer, runner = engine.scheduler.pacer, engine.runner
    recorded, record = [], pacer.record
    pacer.record = lambda *args: (recorded.append(args), record(*args))[1]
    kinds, run = [], runner.run     # per step run: (whether it has chained chunks, whether one decodes beside them)
    runner.run = lambda chunks, *rest: (kinds.append((any(c.chained for c in chunks), any(
        c.request.num_tokens - c.request.num_computed == 1 for c in chunks))), run(chunks, *rest))[1]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = list(range(10, 40))
    request = engine.add_request("first", first, params)
    engine.add_request("long", list(range(50, 90)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    steps = []                                          # per step: (chained, decoding beside, times recorded)

    def step():
        before, ran = len(recorded), len(kinds)
        engine.step()
        steps.append((*(kinds[-1] if ran < len(kinds) else (False, False)), len(recorded) - before))

    while not request.finished:
        step()
    history = first + request.output_ids + list(range(100, 110))
    follow = engine.add_request("follow", history + [7, 8, 9], params, history_len=len(history))
    while not follow.output_ids:
        step()
    assert follow.num_cached > 0
    # chained chunks ran beside decodes: the rest of "long"'s prompt; the follow-up's to its history's end, then on
    assert sum(is_chained and decoding for is_chained, decoding, _ in steps) >= 2
    assert all(n == 0 for is_chained, _, n in steps if is_chained)
    assert all(n == 1 for is_chained, _, n in steps if not is_chained)
    # decode-only steps were timed; no step had eager prefill beside decodes, so no prefill rate was measured
    assert pacer.decode_s is not None and pacer.token_s is None
