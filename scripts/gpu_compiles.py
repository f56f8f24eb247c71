"""On the GPU machine: which Triton kernels compile again after the engine's warm-up, and what a turn that meets one
waits. Agent turns of a few hundred new tokens had reached their first token after 1.1–1.2 s while longer ones took
0.25–0.5 s (BENCHMARKS.md session 16); Triton compiles a kernel once per class of its int arguments (divisible by 16,
equal to 1, other) and per constexpr choice made from a length, so a prompt length of a new class compiles on the
request's path unless the argument is unspecialised (tests/test_triton_specialization.py).

The engine warms up as the server does, then runs follow-up turns of assorted lengths on cached conversations (one
short, below the indexer's top-k blocks, and one from 3,500 tokens; the prefix cache on, as in `bench agentic`) and, after each, prints its first-token time and every kernel whose compiled
variants grew, with how many. Run on a fresh Triton cache to see compiles (the on-disk cache turns a compile into
a load): TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/gpu_compiles.py [--model mem:flash-next --quantize int4]
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time

from triton.runtime.jit import JITFunction

from flashnext.engine.llm import LLM
from flashnext.engine.sampling_params import SamplingParams
from gpu_common import sync


def variants() -> dict[str, int]:
    """Compiled variants per Triton kernel in this process, by qualified name (device caches of every JITFunction;
    an autotuned kernel's configs count as variants too)."""
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, JITFunction):
            name = f"{obj.fn.__module__}.{obj.fn.__name__}"
            counts[name] = counts.get(name, 0) + sum(len(cache[0]) for cache in obj.device_caches.values())
    return counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mem:flash-next")
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--depth", type=int, action="append", default=[],
                    help="a conversation's tokens before its first follow-up (repeatable: one conversation each; "
                         "default 300, below the indexer's top-k blocks, and 3500)")
    ap.add_argument("--new", type=int, action="append", default=[],
                    help="new tokens of each follow-up turn (repeatable; default a spread of classes)")
    args = ap.parse_args()
    llm = LLM(args.model, quantize=args.quantize or None, max_num_seqs=2, kv_cache_gb=16.0)
    engine = llm.engine
    print(f"warm-up: {engine.warm_up():.1f} s")
    before = variants()
    vocab = engine.config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    print(f"{'new tokens':>10} {'context':>8} {'first token ms':>14}  kernels compiled again (variants added)")
    turns = []
    for depth in args.depth or [300, 3500]:
        # short conversations stay short: a few turns below ~2K tokens (the indexer's dense prefill), then the next
        default = [100, 233, 517, 61] if depth < 2000 else [233, 568, 727, 1241, 2344, 3976, 5007, 12563, 100, 517,
                                                              1000, 5003]
        turns += [(depth, new) for new in args.new or default]
    conv = []
    for i, (depth, new) in enumerate(turns):
        if i == 0 or depth != turns[i - 1][0]:
            conv = [rng.randrange(100, vocab - 100) for _ in range(depth)]
        conv = conv + [rng.randrange(100, vocab - 100) for _ in range(new)]
        sync()
        start = time.perf_counter()
        request = engine.add_request(f"turn-{i}", conv, params, history_len=len(conv) - 5)
        first = None
        while engine.has_work():
            engine.step()
            if first is None and request.output_ids:
                first = (time.perf_counter() - start) * 1e3
        after = variants()
        grown = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
        before = after
        listed = ", ".join(f"{k.rsplit('.', 1)[-1]} +{n}" for k, n in sorted(grown.items())) or "none"
        print(f"{new:10} {len(conv):8} {first:14.1f}  {listed}")
        conv = conv + list(request.output_ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
