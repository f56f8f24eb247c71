"""On the GPU machine: where the engine loop's host time goes between decode graph replays.

The captured decode step of full-size Flash-Next INT4 replays in ~5.3 ms, but the engine loop (and the server)
decodes at ~6.3 ms per token: ~1 ms of host work per token during which the GPU waits. This script decodes one
sequence (sampling temperature 0.6, top-p 0.95, top-k 20, as the benchmark does) and prints
- the loop's ms per token, and the time of each part of LLMEngine.step measured around it (schedule, the
  runner's graph replay + sampling launch, the wait for the sampled tokens, appending tokens and outputs), with
  decode ahead off; then the loop's ms per token with it on (LLMEngine.step);
- cProfile's top functions by own time over the same loop (cProfile slows Python down: shares, not times).

    python3 scripts/gpu_host_profile.py [--model mem:flash-next] [--quantize int4] [--tokens 256] [--expert-vram-gb 24]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

from flashnext.engine.llm import LLM
from flashnext.engine.sampling_params import SamplingParams
from gpu_common import sync


def timed_parts(engine, tokens: int) -> dict[str, float]:
    """Run `tokens` decode steps of the one running request, timing the host-side parts of a step (wall time of
    each call, wrapped from outside), and the wait for the sampled tokens apart."""
    runner = engine.runner
    parts: dict[str, float] = {}
    wrapped = [(engine.scheduler, "schedule"), (runner, "_sampling_batch"), (runner.graphs, "_table_delta"),
               (runner, "_sample"), (torch.cuda.CUDAGraph, "replay"), (engine, "_append_token"), (engine, "_output")]
    pool = engine.loaded.expert_cache and engine.loaded.expert_cache.claim_pool
    if pool is not None:   # the expert pools' keeper (--expert-vram-gb)
        wrapped.append((pool, "after_step"))
    originals = [(owner, name, getattr(owner, name)) for owner, name in wrapped if owner is not None]

    def timer(name, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0
        return call

    original_run = runner.run

    def run(chunks, *args):
        t0 = time.perf_counter()
        out = original_run(chunks, *args)
        t1 = time.perf_counter()
        parts["runner.run"] = parts.get("runner.run", 0.0) + t1 - t0
        if out is not None:
            out.token_ids.cpu()   # what step's tolist() waits for, measured apart
        parts["wait for tokens"] = parts.get("wait for tokens", 0.0) + time.perf_counter() - t1
        return out

    for owner, name, fn in originals:
        setattr(owner, name, timer(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}", fn))
    runner.run = run
    try:
        start = time.perf_counter()
        for _ in range(tokens):
            engine.step()
        total = time.perf_counter() - start
    finally:
        runner.run = original_run
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return {"total": total, **parts}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mem:flash-next")
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--expert-vram-gb", type=float, default=None,
                    help="an expert cache of this size (its pools' after_step is timed as a part)")
    ap.add_argument("--tokens", type=int, default=150, help="decode steps timed (40-token prompt: 150 stay in the first "
                    "graph width bucket, so no capture falls inside)")
    args = ap.parse_args()
    llm = LLM(args.model, quantize=args.quantize or None, max_num_seqs=4, enable_prefix_caching=False, kv_cache_gb=8.0,
              expert_vram_gb=args.expert_vram_gb)
    engine = llm.engine
    params = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=args.tokens + 8, ignore_eos=True)
    llm.generate([list(range(20, 60))], SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True))  # graphs

    def start(request_id):   # a fresh request for each measurement: all stay inside the first width bucket
        while engine.has_work():   # the step a decode ahead left in flight for an aborted request
            engine.step()
        engine.add_request(request_id, list(range(20, 60)), params)
        engine.step()   # the prefill
        sync()

    # The parts are timed one step at a time (decode ahead off: their wait for the tokens would drain the queue).
    engine.args.decode_ahead = False
    start("timed")
    parts = timed_parts(engine, args.tokens)
    n = args.tokens
    print(f"engine loop, decode ahead off: {1e3 * parts['total'] / n:.3f} ms per token ({n / parts['total']:.1f} "
          "tok/s); wall time per token of each part (nested parts are inside runner.run):")
    for name, t in parts.items():
        if name != "total":
            print(f"  {name:30} {1e3 * t / n:7.3f} ms")
    engine.abort("timed")
    engine.args.decode_ahead = True
    start("ahead")
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    sync()
    total = time.perf_counter() - t0
    print(f"engine loop, decode ahead on: {1e3 * total / n:.3f} ms per token ({n / total:.1f} tok/s)")
    engine.abort("ahead")
    start("profiled")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        engine.step()
    sync()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)
    engine.abort("profiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
