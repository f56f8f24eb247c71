"""On the GPU machine: the chained steps of DecodeGraphs.extend (a short prompt chunk of a sequence under way),
each replayed alone: ms a replay for every power-of-two size at the given context depths, beside the one-token
decode step and the eager forward of a chunk of that many tokens (and of 256: two 128-row steps against one eager
step, --graph-extend-max's default), and the kernels of the largest chained step by the profiler.

    python3 scripts/gpu_extend.py [--model mem:flash-next] [--quantize int4] [--context 3500 --context 58000]

The rows point at the graphs' scratch slot and block (every page of its table is the scratch block): the work is
the real step's at that depth — attention and the QSA indexer read `context` tokens of (garbage) KV — and no
sequence's state is touched.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from flashnext.engine.cuda_graph import MIN_WIDTH, bucket
from flashnext.engine.llm import LLM
from gpu_decode import profile_kernels, replayed_ms


@torch.inference_mode()
def eager_ms(engine, graphs, size: int, context: int, width: int, runs: int = 3) -> float:
    """ms of the eager forward (and the last row's logits) of a chunk of `size` tokens at `context`, synchronised,
    the median of `runs` after one: the scratch slot, a table of the scratch block (the same reads as the real
    chunk's, into garbage)."""
    from flashnext.models.context import ForwardContext, Segment

    model, device = engine.loaded.model, engine.kv.device
    blocks = torch.full((width,), graphs.scratch_block, dtype=torch.long, device=device)
    ids = torch.randint(100, engine.config.vocab_size - 100, (size,), device=device)
    times = []
    for _ in range(runs + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        ctx = ForwardContext([Segment(graphs.scratch_slot, blocks, 0, size, context)], engine.kv, engine.states)
        model.compute_logits(model(ids, ctx)[-1:])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[1:])[runs // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mem:flash-next")
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--context", type=int, action="append", default=[])
    args = ap.parse_args()
    llm = LLM(args.model, quantize=args.quantize or None, max_num_seqs=2, kv_cache_gb=16.0,
              enable_prefix_caching=False)
    engine = llm.engine
    graphs = engine.runner.graphs
    sizes = graphs.chain_steps
    if not sizes:
        print("no chained steps: the engine runs short chunks eagerly here (LLMEngine._extends_capturable)")
        return 1
    print(f"{'context':>8} {'width':>6} {'decode ms':>9} " + " ".join(f"{f'x{s} ms':>8}" for s in sizes)
          + "   (tok/s of each chained step below)")
    largest = None
    for context in args.context or [3500, 58000]:
        blocks = engine.kv.blocks_for(context + sizes[-1])
        decode_width, width = bucket(blocks, MIN_WIDTH), graphs._chain_width(blocks)   # what extend runs
        if (1, decode_width) not in graphs.graphs:
            graphs._capture(1, decode_width)
        graphs.inputs[1].fill_(context)   # after the capture, whose warm-up zeroed the inputs
        decode_ms = replayed_ms(graphs.graphs[(1, decode_width)][0])
        times = []
        for size in sizes:
            if (size, width) not in graphs.chain_graphs:
                graphs._capture(size, width, chained=True)
            graphs.chain_inputs[0].random_(100, engine.config.vocab_size - 100)
            graphs.chain_inputs[1].copy_(torch.arange(context, context + graphs.chain_inputs.shape[1]))
            graphs.chain_inputs[2].fill_(graphs.scratch_slot)
            times.append(replayed_ms(graphs.chain_graphs[(size, width)][0], steps=20))
        print(f"{context:8} {width:6} {decode_ms:9.3f} " + " ".join(f"{t:8.3f}" for t in times))
        print(f"{'':8} {'':6} {1e3 / decode_ms:9.0f} " + " ".join(f"{s * 1e3 / t:8.0f}" for s, t in zip(sizes, times)))
        eager = [eager_ms(engine, graphs, size, context, width) for size in sizes + [2 * sizes[-1]]]
        print(f"{'eager':>8} {'':6} {'':9} " + " ".join(f"{t:8.3f}" for t in eager[:-1])
              + f"   {2 * sizes[-1]} tokens: eager {eager[-1]:.3f} ms, two chained steps {2 * times[-1]:.3f} ms")
        largest = width
    print(f"\nthe chained step of {sizes[-1]} rows, {largest} blocks wide, run eagerly under the profiler:")
    with torch.inference_mode():
        profile_kernels(lambda: graphs._step(sizes[-1], largest, chained=True), runs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
