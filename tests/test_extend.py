"""Short prompt chunks of a sequence under way through chained steps (DecodeGraphs.extend, models/decode_batch.py):
the same logits, states, KV rows and pooled index keys as the eager forward of that chunk, for every architecture,
across the QSA indexer's dense/sparse threshold and the chunked form of the delta rule; and through the engine, a
multi-turn conversation whose follow-ups hit the prefix cache gives the eager engine's tokens."""
import pytest
import torch

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.state_pool import StatePool
from flashnext.engine.cuda_graph import DecodeGraphs, bucket, chain_sizes
from flashnext.models.context import ForwardContext, Segment
from oracle import hf_model, ours_from_hf, rel_err
from test_decode_runner import follow_up_conversation
from test_model_parity import CASES, IDS

TOL = 1e-5
PROMPT = 5    # below the tiny QSA budgets (8–12 tokens): the chunk crosses into the scored selection


def test_chain_sizes_are_the_largest_steps_then_the_binary_digits():
    assert chain_sizes(75) == [64, 8, 2, 1]
    assert chain_sizes(64) == [64]
    assert chain_sizes(3) == [2, 1]
    assert chain_sizes(300) == [128, 128, 32, 8, 4] and chain_sizes(300, 64) == [64] * 4 + [32, 8, 4]
    assert all(sum(chain_sizes(n, largest)) == n for n in range(1, 600) for largest in (16, 128))


def _pools(cfg, num_blocks):
    kv = KVPool(cfg, num_blocks, KVPool.fit_block_size(cfg, 8), torch.float32, "cpu")
    return kv, StatePool(cfg, 4, torch.float32, "cpu")


def _eager_chunk(model, kv, states, slot, table, ids, context_len):
    hidden = model(ids, ForwardContext([Segment(slot, torch.tensor(table), 0, len(ids), context_len)], kv, states))
    return model.compute_logits(hidden[-1:])


# 2 and 16: one chained step, the logits its last row's; 16 and 128 rows: the chunked delta rule (128: two chunks of
# 64); 13: rows one by one through the GatedDeltaNet decode kernels, then a decode step
# widest: the graphs' widest block table (None: the sequence's own); 300 blocks make the chained steps' table 256 wide
# (CHAIN_MIN_WIDTH), as a GPU engine's is for any context under 4K tokens — the QSA indexer then scores its slots
@pytest.mark.parametrize("chunk,max_chain,widest", [
    (2, 256, None), (13, 256, None), (16, 256, None), (37, 256, None), (128, 256, None), (200, 256, None),
    (300, 256, None), (100, 100, None), (13, 256, 300), (37, 256, 300)],
    ids=["2", "8+4+1", "16", "32+4+1", "128", "128+64+8", "128+128+32+8+4", "64+32+4", "8+4+1-wide", "32+4+1-wide"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_extend_equals_eager_chunk(case, chunk, max_chain, widest):
    arch, overrides = case
    hf, raw = hf_model(arch, seed=CASES.index(case), **overrides)
    model = ours_from_hf(hf, raw)
    cfg = model.cfg
    g = torch.Generator().manual_seed(11)
    prompt, more = (torch.randint(2, cfg.vocab_size, (n,), generator=g) for n in (PROMPT, chunk))
    eager, fixed = _pools(cfg, 80), _pools(cfg, 80)
    need = eager[0].blocks_for(PROMPT + chunk + 1)
    tables = [pools[0].allocate(need) for pools in (eager, fixed)]
    slots = [pools[1].allocate() for pools in (eager, fixed)]
    assert tables[0] == tables[1] and slots[0] == slots[1]
    table, slot = tables[0], slots[0]
    graphs = DecodeGraphs(model, *fixed, max_batch=1, max_blocks_per_seq=widest or need, max_chain=max_chain)
    assert graphs._chain_width(need) == (256 if widest else bucket(need, 16))
    with torch.inference_mode():
        for pools in (eager, fixed):
            _eager_chunk(model, *pools, slot, table, prompt, 0)
        want = _eager_chunk(model, *eager, slot, table, more, PROMPT)
        got = graphs.extend(more.tolist(), PROMPT, slot, table)
        assert got.shape == want.shape and rel_err(got, want) < TOL
        # an odd chunk ends in a single token, which replays the decode step at its own width; an even one never does
        assert set(graphs.graphs) == ({(1, bucket(need, 16))} if chunk % 2 else set())
        # and the sequence goes on from there: one decode step after the chunk
        token = int(want.argmax())
        want = _eager_chunk(model, *eager, slot, table, torch.tensor([token]), PROMPT + chunk)
        assert rel_err(graphs.run([token], [PROMPT + chunk], [slot], [table]), want) < TOL
    if arch == "qwen4_exp" and chunk > 8:   # the chunk crosses the budget: its rows switch to the scored selection
        assert PROMPT < cfg.indexer_budget < PROMPT + chunk
    total = PROMPT + chunk + 1
    for name, t in eager[1].tensors().items():
        # the ring's rows past the incomplete block's tokens are stale in both, not the same stale ones
        held = slice(total % cfg.indexer_compress_ratio) if name.startswith("index_ring") else slice(None)
        assert rel_err(fixed[1].tensors()[name][slot][held].float(), t[slot][held].float()) < TOL, name
    rows = eager[0].token_rows(torch.tensor(table), 0, total)
    for layer in cfg.attention_layers():
        for cache in ("k", "v"):
            pages = [getattr(pools[0], cache)[layer] for pools in (fixed, eager)]
            got, want = (p.view(-1, *p.shape[2:])[rows] for p in pages)
            assert rel_err(got, want) < TOL, (cache, layer)
        if arch == "qwen4_exp":   # the pooled index keys of the blocks the chunk completed
            per_page = eager[0].index_keys[layer].shape[1]
            blocks = torch.arange(total // cfg.indexer_compress_ratio)
            key_rows = torch.tensor(table)[blocks // per_page] * per_page + blocks % per_page
            got, want = (pools[0].index_keys[layer].view(-1, cfg.indexer_head_dim)[key_rows] for pools in (fixed, eager))
            assert rel_err(got, want) < TOL, layer


def _chained_engine(**args):
    """A CPU engine with what a GPU engine has beside its decode graphs: DecodeGraphs that run chained steps of up to
    16 tokens (uncaptured here) and a scheduler that marks such chunks."""
    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(**args))
    engine.runner.graphs = DecodeGraphs(engine.runner.model, engine.kv, engine.states, max_batch=4,
                                        max_blocks_per_seq=engine.kv.blocks_for(engine.max_model_len), max_chain=16)
    engine.scheduler.extend_max = 16
    return engine


def test_engine_follow_up_turns_extend_through_chained_steps():
    """A conversation's follow-up turns hit the prefix cache and prefill their new message and generation prompt
    through DecodeGraphs.extend (every such chunk: several tokens, a sequence under way); the tokens and the cached
    counts equal the eager engine's."""
    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine
    from flashnext.engine.sampling_params import SamplingParams

    args, conversation = follow_up_conversation()
    want = conversation(LLMEngine(EngineArgs(**args)))
    engine = _chained_engine(**args)
    runner = engine.runner
    extended = []
    original = runner.graphs.extend

    def spy(tokens, start, slot, blocks):
        extended.append(len(tokens))
        return original(tokens, start, slot, blocks)

    runner.graphs.extend = spy
    got = conversation(engine)
    assert got == want
    assert all(cached > 0 for _, cached in got[1:])
    assert len(extended) >= 4 and all(1 < n <= 16 for n in extended)
    # a short prompt that starts a sequence runs eagerly (chained steps continue a slot's states, never clear them),
    # and so does a chunk the budget cut short (the prompt goes on in large eager chunks)
    fresh = engine.add_request("fresh", list(range(5, 13)), SamplingParams(max_tokens=1))
    chains = engine.scheduler._chains
    assert not chains(fresh, 0, 8) and chains(fresh, 2, 6) and not chains(fresh, 2, 4)


def test_step_with_two_extends_and_a_decode_keeps_every_chunks_logits():
    """Two follow-ups whose short chunks extend in the same step as another sequence's decode: each chunk's logits
    survive the later replays (extend returns a copy; the decode replay comes last), the tokens equal the eager
    engine's. Nothing is captured on a CPU, so each step's output goes to one buffer per graph here, as a graph's
    static output does."""
    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine
    from flashnext.engine.sampling_params import SamplingParams

    args = dict(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                decode_ahead=False)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    g = torch.Generator().manual_seed(8)
    firsts = [torch.randint(3, 400, (20,), generator=g).tolist() for _ in range(3)]
    news = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (11, 6)]

    def run(engine, spy=None):
        outputs = {}

        def drain(steps=None):
            while engine.has_work() and steps != 0:
                for o in engine.step():
                    outputs.setdefault(o.request_id, []).extend(o.token_ids)
                steps = None if steps is None else steps - 1

        for i, prompt in enumerate(firsts[:2]):
            engine.add_request(f"first{i}", prompt, params)
        drain()
        engine.add_request("long", firsts[2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        drain(steps=3)                                         # "long" is decoding now
        for i in range(2):
            engine.add_request(f"follow{i}", firsts[i] + outputs[f"first{i}"] + news[i], params)
        drain()
        return outputs

    want = run(LLMEngine(EngineArgs(**args)))
    engine = _chained_engine(**args)
    runner = engine.runner
    static, fixed_shape_step = {}, runner.graphs._step

    def static_output(size, width, chained=False):
        out = fixed_shape_step(size, width, chained)
        return static.setdefault((size, width, chained), torch.empty_like(out)).copy_(out)

    runner.graphs._step = static_output
    steps = []
    run_step, extend, replay = runner.run, runner.graphs.extend, runner._replay

    def spy_run(chunks, *rest):
        steps.append([])
        return run_step(chunks, *rest)

    runner.run = spy_run
    runner.graphs.extend = lambda *a: steps[-1].append("extend") or extend(*a)
    runner._replay = lambda *a: steps[-1].append("decode") or replay(*a)
    assert run(engine) == want
    assert ["extend", "extend", "decode"] in steps


def test_chained_chunks_are_not_held_back_like_eager_prefill():
    """--decode-steps-between-prefill holds eager prefill chunks back after one ran beside decodes; a follow-up's
    chunks that replay chained steps (its history's new tokens, then its generation prompt) neither wait for those
    steps nor cause them: its first token comes two steps after it is admitted, while another sequence decodes."""
    from flashnext.engine.sampling_params import SamplingParams

    engine = _chained_engine(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=4,
                             max_num_batched_tokens=64, decode_ahead=False, decode_steps_between_prefill=3)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = list(range(10, 40))
    request = engine.add_request("first", first, params)
    while engine.has_work():
        engine.step()
    engine.add_request("long", list(range(50, 90)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()                                    # "long" decodes
    history = first + request.output_ids + list(range(100, 110))
    follow = engine.add_request("follow", history + [7, 8, 9], params, history_len=len(history))
    steps = 0
    while not follow.output_ids:
        engine.step()
        steps += 1
    assert follow.num_cached > 0 and steps == 2
    assert engine.scheduler._decode_only_steps == 0


def test_engine_turns_chained_steps_on_only_where_they_can_run():
    """INT4 experts on one device: chained steps; 16-bit experts (their decode form gathers every row's weights), an
    expert cache (its eager path syncs) or several GPUs (workers are told decode steps only): not."""
    from dataclasses import replace

    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine

    args = EngineArgs(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=2)
    assert not LLMEngine(args)._extends_capturable()
    int4 = LLMEngine(replace(args, quantize="int4"))
    assert int4._extends_capturable()
    int4.args = replace(int4.args, expert_parallel=2)
    assert not int4._extends_capturable()
    assert not LLMEngine(replace(args, quantize="int4", expert_vram_gb=0.001))._extends_capturable()


def test_engine_sets_chained_steps_or_the_graph_tail(monkeypatch):
    """With decode graphs (forced on a CPU engine, which runs them uncaptured): chained chunks up to
    --graph-extend-max in steps of at most 128, and no token-a-step tail; without chained steps (16-bit experts,
    --graph-extend-max 0 or 1) the tail instead; a negative limit is refused."""
    from dataclasses import replace

    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "_use_cuda_graphs", lambda self: True)
    args = EngineArgs(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=2, quantize="int4")
    engine = LLMEngine(args)
    assert (engine.scheduler.extend_max, engine.scheduler.graph_tail) == (args.graph_extend_max, 0)
    assert engine.runner.graphs.chain_steps == [2, 4, 8, 16, 32]   # the default 48: chained steps up to 32 rows
    assert LLMEngine(replace(args, graph_extend_max=256)).runner.graphs.chain_steps == [2, 4, 8, 16, 32, 64, 128]
    assert engine.runner.row_graphs is not None   # longer chunks: row-wise graphs (engine/row_graphs.py)
    for off in (replace(args, quantize=None), replace(args, graph_extend_max=1), replace(args, graph_extend_max=0)):
        engine = LLMEngine(off)
        assert (engine.scheduler.extend_max, engine.scheduler.graph_tail) == (0, args.graph_prefill_tail)
        assert engine.runner.graphs.chain_steps == []
        assert (engine.runner.row_graphs is None) == (off.quantize is None)
    with pytest.raises(ValueError, match="--graph-extend-max"):
        LLMEngine(replace(args, graph_extend_max=-1))
