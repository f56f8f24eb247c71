"""On the GPU machine: where the engine loop's host time goes between decode graph replays.

The captured decode step of full-size Flash-Next INT4 replays in ~5.3 ms, but the engine loop (and the server)
decodes at ~6.3 ms per token: ~1 ms of host work per token during which the GPU waits. This script decodes one
sequence (sampling temperature 0.6, top-p 0.95, top-k 20, as the benchmark does) and prints
- the loop's ms per token, and the time of each part of LLMEngine.step measured around it (schedule, the
  runner's graph replay + sampling launch, the wait for the sampled tokens, appending tokens and outputs);
- cProfile's top functions by own time over the same loop (cProfile slows Python down: shares, not times).

    python3 scripts/gpu_host_profile.py [--model mem:flash-next] [--quantize int4] [--tokens 256]
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


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_parts(engine, tokens: int) -> dict[str, float]:
    """Run `tokens` decode steps of the one running request, timing the parts of LLMEngine.step from outside."""
    parts = {"schedule": 0.0, "runner.run (launch)": 0.0, "wait for tokens": 0.0, "append + outputs": 0.0}
    runner, scheduler = engine.runner, engine.scheduler
    original_run = runner.run

    def run(chunks):
        t0 = time.perf_counter()
        out = original_run(chunks)
        t1 = time.perf_counter()
        if out is not None:
            out.token_ids.cpu()   # what step's tolist() waits for, measured apart
        parts["runner.run (launch)"] += t1 - t0
        parts["wait for tokens"] += time.perf_counter() - t1
        return out

    original_schedule = scheduler.schedule

    def schedule():
        t0 = time.perf_counter()
        out = original_schedule()
        parts["schedule"] += time.perf_counter() - t0
        return out

    runner.run, scheduler.schedule = run, schedule
    try:
        start = time.perf_counter()
        for _ in range(tokens):
            engine.step()
        total = time.perf_counter() - start
    finally:
        runner.run, scheduler.schedule = original_run, original_schedule
    parts["append + outputs"] = total - sum(parts.values())
    return {"total": total, **parts}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mem:flash-next")
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    llm = LLM(args.model, quantize=args.quantize or None, max_num_seqs=4, enable_prefix_caching=False, kv_cache_gb=8.0)
    engine = llm.engine
    params = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=args.tokens * 2 + 16, ignore_eos=True)
    llm.generate([list(range(20, 60))], SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True))  # graphs
    engine.add_request("profiled", list(range(20, 80)), params)
    engine.step()   # the prefill
    sync()
    parts = timed_parts(engine, args.tokens)
    n = args.tokens
    print(f"engine loop: {1e3 * parts['total'] / n:.3f} ms per token ({n / parts['total']:.1f} tok/s)")
    for name, t in parts.items():
        if name != "total":
            print(f"  {name:22} {1e3 * t / n:7.3f} ms per token")
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
