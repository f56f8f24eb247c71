"""The engine with the fixed-shape decode runner (engine/cuda_graph.py; on a CPU it runs without capturing)
gives the same greedy tokens as the eager runner, with requests arriving while others decode, so steps mix
prefill chunks (eager) with decodes (fixed-shape) and the batch buckets pad with scratch rows."""
import pytest
import torch

from flashnext.engine.args import EngineArgs
from flashnext.engine.cuda_graph import DecodeGraphs
from flashnext.engine.llm_engine import LLMEngine
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
