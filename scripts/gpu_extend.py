"""On the GPU machine: the chained steps of DecodeGraphs.extend (a short prompt chunk of a sequence under way),
each replayed alone: ms a replay for every power-of-two size at the given context depths, beside the one-token
decode step, and the kernels of the largest chained step by the profiler.

    python3 scripts/gpu_extend.py [--model mem:flash-next] [--quantize int4] [--context 3500 --context 58000]

The rows point at the graphs' scratch slot and block (every page of its table is the scratch block): the work is
the real step's at that depth — attention and the QSA indexer read `context` tokens of (garbage) KV — and no
sequence's state is touched.
"""
from __future__ import annotations

import argparse
import sys

import torch

from flashnext.engine.cuda_graph import MIN_WIDTH, bucket
from flashnext.engine.llm import LLM
from gpu_decode import profile_kernels, replayed_ms


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
        width = bucket(engine.kv.blocks_for(context + sizes[-1]), MIN_WIDTH)
        graphs.inputs[1].fill_(context)
        if (1, width) not in graphs.graphs:
            graphs._capture(1, width)
        graphs.inputs[1].fill_(context)   # the capture's warm-up zeroed the inputs
        decode_ms = replayed_ms(graphs.graphs[(1, width)][0])
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
        largest = width
    print(f"\nthe chained step of {sizes[-1]} rows, {largest} blocks wide, run eagerly under the profiler:")
    with torch.inference_mode():
        profile_kernels(lambda: graphs._step(sizes[-1], largest, chained=True), runs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
