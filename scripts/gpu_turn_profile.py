"""On the GPU machine: where a follow-up turn's time to first token goes when most of its prompt is cached.

The agentic benchmark's engine log showed 0.39 s from arrival to first token for a turn that adds 182 tokens to a
3.5K-token cached conversation, and 0.72 s for 253 tokens on 32K (full-size Flash-Next INT4, H200) — far more than
the new tokens' prefill. This script runs such conversations in the engine (prefix cache on, a host tier, the
chat's history cut as the server passes it) and prints each step of a follow-up turn until its first token: the
chunks it ran (tokens, context), its wall time (synchronised), and the top kernels and host-side ops of the
turn's prefill by the profiler.

    python3 scripts/gpu_turn_profile.py [--model mem:flash-next] [--quantize int4] [--depth 3500 --depth 32000]
        [--new 600 --new 4000] [--python] [--variant rows=off] [--no-profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from contextlib import contextmanager, nullcontext

import torch
from torch.profiler import ProfilerActivity, profile

from flashnext.engine.llm import LLM
from flashnext.engine.sampling_params import SamplingParams
from gpu_common import environment, row_graphs_off, sync


def first_token_steps(engine, request_id, prompt, params, history_len):
    """Add the request and step until it has a token: [(tokens computed before → after the step, wall ms)]."""
    sync()
    t0 = time.perf_counter()
    request = engine.add_request(request_id, prompt, params, history_len=history_len)
    steps = []
    while not request.output_ids:
        t, before = time.perf_counter(), request.num_computed
        engine.step()
        sync()
        steps.append((f"{before}→{request.num_computed}", (time.perf_counter() - t) * 1e3))
    return steps, (time.perf_counter() - t0) * 1e3, request


@contextmanager
def variant(engine, setting: str | None):
    """`NAME=VALUE` for the turn: an environment switch, `extend=off` (the short chunk eager, its generation prompt
    fed one token a step: the engine without DecodeGraphs.extend) or `rows=off` (eager steps without row-wise
    graphs: --graph-prefill-max 0)."""
    if setting is None:
        yield
    elif setting == "rows=off":
        with row_graphs_off(engine):
            yield
    elif setting == "extend=off":   # the scheduler marks the chunks that replay chained steps (Scheduler._chains)
        scheduler = engine.scheduler
        chain, tail = scheduler.extend_max, scheduler.graph_tail
        scheduler.extend_max, scheduler.graph_tail = 0, engine.args.graph_prefill_tail
        try:
            yield
        finally:
            scheduler.extend_max, scheduler.graph_tail = chain, tail
    else:
        name, _, value = setting.partition("=")
        with environment({name: value}):
            yield


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mem:flash-next")
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--depth", type=int, action="append", default=[])
    ap.add_argument("--new", type=int, action="append", default=[], help="tokens a follow-up adds (repeatable: the "
                    "turns of each size in turn, on one conversation; default 200)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--python", action="store_true",
                    help="profile the host's Python instead (cProfile, the functions by own and cumulative time): where "
                         "an eager step's host time goes")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE",
                    help="also run two turns with this environment switch set (one read on the eager path per call, "
                         "e.g. FLASHNEXT_HC_DECODE_MAX_ROWS=256), or extend=off; repeatable")
    ap.add_argument("--no-profile", action="store_true", help="no profiled turn")
    args = ap.parse_args()
    llm = LLM(args.model, quantize=args.quantize or None, max_num_seqs=2, kv_cache_gb=16.0, kv_host_gb=8.0,
              device=args.device)
    engine = llm.engine
    rows = engine.runner.row_graphs
    print(f"warm-up (graph captures included): {engine.warm_up():.1f} s; chained graphs "
          f"{len(engine.runner.graphs.chain_graphs) if engine.runner.graphs else 0}; row-wise plans "
          f"{sorted(rows.plans) if rows else None}")
    vocab = engine.config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for depth in args.depth or [3500, 32000]:
        conv = [rng.randrange(100, vocab - 100) for _ in range(depth)]
        reply = llm.generate([conv], params)[0].token_ids
        # Turns alternate between the defaults and each variant (two each), then one profiled with the defaults.
        settings = [None] + args.variant
        plan = [(new, settings[i % len(settings)]) for new in args.new or [200] for i in range(2 * len(settings))]
        plan += [] if args.no_profile else [(new, "profiled") for new in args.new or [200]]
        for turn, (new, setting) in enumerate(plan):
            conv = conv + reply + [rng.randrange(100, vocab - 100) for _ in range(new)]
            profiled = setting == "profiled"
            python = cProfile.Profile() if profiled and args.python else None
            torch_profile = profiled and not args.python
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if torch_profile else nullcontext() as prof, \
                    variant(engine, None if profiled else setting):
                if python is not None:
                    python.enable()
                steps, total, request = first_token_steps(engine, f"d{depth}-t{turn}", conv, params, len(conv) - 5)
                if python is not None:
                    python.disable()
            label = " (profiled)" if profiled else f" [{setting}]" if setting else ""
            print(f"depth {depth} turn {turn}{label}: prompt {len(conv)}, cached "
                  f"{request.num_cached}: first token in {total:.1f} ms over {len(steps)} steps: "
                  + ", ".join(f"{label} {ms:.1f} ms" for label, ms in steps))
            if python is not None:
                stats = pstats.Stats(python)
                stats.sort_stats("tottime").print_stats(35)
                stats.sort_stats("cumtime").print_stats(r"flashnext|fla/", 45)
            elif profiled:
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
                if torch.cuda.is_available():
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))
            while engine.has_work():
                engine.step()
            reply = list(request.output_ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
