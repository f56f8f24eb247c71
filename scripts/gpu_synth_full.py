"""On the GPU machine: build full-size Flash-Next (177B parameters) in memory and check that it runs.

No checkpoint: weights/synth_device.py draws INT4 experts and dense projections (random codes, signed scales) and
the 16-bit tensors on the GPU, and fills the PLE n-gram table (320,001,536 × 160) chunk by chunk into pinned host
memory, fp8 with one scale by default (51 GB; bf16 would be 102 GB, too much beside everything else on a 125 GiB
host, so it is refused unless the host has room). Then, eager through Session:
  - a 256-token prefill, with the routed experts each layer used (zero-mean weights spread tokens over ~all 512);
  - a few single-token forwards: finite logits, ms per token (eager, so launch-bound: not a decode benchmark);
  - the PLE gather alone (16 rows per token, read over PCIe by a Triton kernel): µs per call eager and replayed
    in a CUDA graph, against the torch reference (gather on the host + copy), and checked equal to it.
Prints a table at the end; exits non-zero when something is wrong. Expect ~63 GB of INT4 experts and ~7 GB of
other tensors on the GPU, 51 GB pinned on the host, and a build of well under a minute plus Triton compiles.
Run: python3 scripts/gpu_synth_full.py [--preset flash-next] [--layers N] [--ple-dtype fp8|bf16]
                                       [--ple-placement host|device] [--decode-tokens 4]
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time

import torch

from flashnext.models.layers.moe import Router
from flashnext.models.layers.row_table import RowTable
from flashnext.models.session import Session
from flashnext.ops.host_gather import gather_rows
from flashnext.weights.config import parse_config
from flashnext.weights.pinned import meminfo_bytes
from flashnext.weights.presets import get_preset
from flashnext.weights.synth_device import build_synthetic_model

PREFILL_TOKENS = 256
GATHER_TOKENS = (1, 8, 512, 4096)
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def meminfo(field: str, path: str = "/proc/meminfo") -> float:
    """GB of a /proc meminfo-style field (nan where there is none)."""
    nbytes = meminfo_bytes(field, path)
    return float("nan") if nbytes is None else nbytes / 1e9


def time_cuda(fn, iters: int) -> float:
    """µs per call of fn, by CUDA events around `iters` back-to-back calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def time_gather(table: RowTable, tokens: int, rows_per_token: int, dtype) -> dict:
    num_rows = table.weight.shape[0]
    rows = torch.randint(0, num_rows, (tokens, rows_per_token), device="cuda")
    got = table(rows, dtype)
    want = gather_rows(table.weight, rows.cpu(), dtype, table.scale)
    ok = torch.equal(got.cpu(), want)
    for _ in range(3):
        table(rows, dtype)
    eager = time_cuda(lambda: table(rows, dtype), 200)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        table(rows, dtype)  # warm the graph's memory pool
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = table(rows, dtype)
    graph.replay()
    torch.cuda.synchronize()
    ok = ok and torch.equal(out.cpu(), want)
    replay = time_cuda(graph.replay, 200)
    nbytes = rows.numel() * table.weight.shape[1] * table.weight.element_size()
    row = {"tokens": tokens, "rows": rows.numel(), "eager_us": eager, "graph_us": replay,
           "GB/s": nbytes / (replay * 1e-6) / 1e9, "equal": ok}
    if tokens == 1:  # the alternative: indices to the host, gather there, copy back (a sync each time)
        t = time.perf_counter()
        for _ in range(50):
            gather_rows(table.weight, rows.cpu(), dtype, table.scale).to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        row["host_gather_us"] = (time.perf_counter() - t) / 50 * 1e6
    return row


def expert_coverage(model, session: Session, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, float]:
    """Logits of a prefill of `ids`, and the fraction of experts each layer's router picked (min over layers)."""
    used, hooks = {}, []

    def count(name):
        def hook(module, args, out):
            used[name] = out[1].unique().numel()
        return hook

    for name, module in model.named_modules():
        if isinstance(module, Router):
            hooks.append(module.register_forward_hook(count(name)))
    try:
        logits = session.extend(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return logits, min(used.values(), default=0) / num_experts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="flash-next")
    parser.add_argument("--layers", type=int, default=None, help="build only N layers (a quicker check)")
    parser.add_argument("--ple-dtype", choices=("fp8", "bf16"), default="fp8")
    parser.add_argument("--ple-placement", choices=("host", "device", "auto"), default="host")
    parser.add_argument("--decode-tokens", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.manual_seed(0)

    cfg = parse_config(get_preset(args.preset, layers=args.layers))
    ple_dtype = torch.float8_e4m3fn if args.ple_dtype == "fp8" else torch.bfloat16
    table_gb = cfg.ngram_vocab_size_base * cfg.ple_embed_dim * ple_dtype.itemsize / 1e9 if cfg.ple_layers else 0.0
    available = meminfo("MemAvailable")
    say(f"{torch.cuda.get_device_name()}: {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB; "
        f"host {meminfo('MemTotal'):.0f} GB, {available:.0f} GB available; PLE table ≈ {table_gb:.1f} GB {ple_dtype}")
    if args.ple_placement != "device" and table_gb > available - 16:
        say(f"refusing: a {table_gb:.0f} GB host table leaves under 16 GB of the {available:.0f} GB available "
            "(use --ple-dtype fp8)")
        return 2

    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = build_synthetic_model(cfg, "cuda", torch.bfloat16, seed=0, int4=True, ple_placement=args.ple_placement,
                                  ple_dtype=ple_dtype)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    free, total = torch.cuda.mem_get_info()
    table = next(m for m in model.modules() if isinstance(m, RowTable))
    results = {
        "build s": f"{build_s:.1f}",
        "GPU allocated GB": f"{torch.cuda.memory_allocated() / 1e9:.1f} "
                            f"(peak {torch.cuda.max_memory_allocated() / 1e9:.1f})",
        "GPU used GB (mem_get_info)": f"{(total - free) / 1e9:.1f} of {total / 1e9:.1f}",
        "PLE table": f"{table.nbytes / 1e9:.1f} GB {table.weight.dtype} {table.placement}, "
                     f"pinned={table.weight.is_pinned()}",
        "process RSS GB": f"{meminfo('VmRSS', '/proc/self/status'):.1f}",
    }
    say(f"built in {build_s:.1f} s")

    session = Session(model, PREFILL_TOKENS + args.decode_tokens + 8)
    ids = torch.randint(0, cfg.vocab_size, (PREFILL_TOKENS,), device="cuda")
    start = time.perf_counter()
    logits, coverage = expert_coverage(model, session, ids, cfg.num_experts)
    torch.cuda.synchronize()
    results[f"prefill {PREFILL_TOKENS} eager s (incl. compiles)"] = f"{time.perf_counter() - start:.1f}"
    uniform = 1 - math.exp(-PREFILL_TOKENS * cfg.num_experts_per_tok / cfg.num_experts)  # expected if uniform
    results["experts used per layer (min)"] = f"{coverage:.1%} (uniform routing ≈ {uniform:.1%})"
    finite = bool(logits.isfinite().all())
    token_ms = []
    for _ in range(args.decode_tokens):
        start = time.perf_counter()
        logits = session.extend([int(logits.argmax())])
        torch.cuda.synchronize()
        token_ms.append((time.perf_counter() - start) * 1e3)
        finite = finite and bool(logits.isfinite().all())
    results["single-token forwards ms (eager)"] = " ".join(f"{t:.0f}" for t in token_ms)
    results["logits finite"] = str(finite)
    results["logits std"] = f"{logits.float().std().item():.3f}"
    results["table still on host"] = str(table.weight.device.type == "cpu") if table.placement == "host" else "n/a"
    say("forwards done")

    gathers = [time_gather(table, t, 16, torch.bfloat16) for t in GATHER_TOKENS]
    say("gathers timed")

    width = max(len(k) for k in results)
    print("\n| what | value |\n|---|---|")
    for key, value in results.items():
        print(f"| {key:<{width}} | {value} |")
    print("\n| PLE gather: tokens | rows | eager µs | CUDA graph µs | GB/s (graph) | equal to reference "
          "| host gather + copy µs |")
    print("|---|---|---|---|---|---|---|")
    for g in gathers:
        print(f"| {g['tokens']} | {g['rows']} | {g['eager_us']:.1f} | {g['graph_us']:.1f} | {g['GB/s']:.2f} | "
              f"{g['equal']} | {g.get('host_gather_us', float('nan')):.1f} |")
    say("done")
    good = finite and coverage > 0.8 and all(g["equal"] for g in gathers)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
