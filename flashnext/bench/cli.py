"""`flashnext bench …`: the arguments (each also an env var FLASHNEXT_BENCH_<NAME>) and the entry point."""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from pathlib import Path

from flashnext.bench import report
from flashnext.bench.client import BenchError
from flashnext.bench.progress import Progress
from flashnext.bench.results import commit_from_env
from flashnext.bench.runner import ALL, BENCHES, bench_module, run_bench as run_one
from flashnext.bench.target import open_target

ENV_PREFIX = "FLASHNEXT_BENCH_"


def _env(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def _add(parser, flag: str, *, default=None, type=str, help: str, action=None):
    """A flag whose default comes from FLASHNEXT_BENCH_<NAME> when that is set."""
    dest = flag.lstrip("-").replace("-", "_")
    raw = os.environ.get(_env(dest))
    help = f"{help} [env {_env(dest)}]"
    if action == "store_true":
        value = raw.strip().lower() in ("1", "true", "yes", "on") if raw is not None else False
        parser.add_argument(flag, action="store_true", default=value, help=help)
        return
    if raw is not None:
        try:
            default = type(raw)
        except ValueError:
            raise SystemExit(f"{_env(dest)}={raw!r} is not a valid value for {flag}.") from None
    parser.add_argument(flag, type=type, default=default, help=f"{help} (default: {default})")


def scale_value(text: str) -> float | str:
    """--scale: a positive factor, or "auto"."""
    if text == "auto":
        return text
    value = float(text)
    if value <= 0:
        raise ValueError(text)
    return value


def _bench_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("server under test (one of --url and --model)")
    _add(g, "--url", help="an OpenAI-compatible server (ours, vLLM, llama.cpp), e.g. http://host:8000")
    _add(g, "--api-key", help="bearer token for --url")
    _add(g, "--model-name", help="model id to request (default: the first of /v1/models)")
    _add(g, "--model", help="checkpoint dir or preset: start our server for the run and stop it after")
    _add(g, "--server-args", default="", help='extra flags for `flashnext serve`, e.g. "--kv-host-gb 64"')
    _add(g, "--server-timeout", type=float, default=1800.0, help="seconds to wait for /health 200")
    _add(g, "--request-timeout", type=float, default=3600.0, help="seconds one request may take")
    g = p.add_argument_group("output")
    _add(g, "--out-dir", default="bench/results", help="where results JSON and plots go")
    _add(g, "--no-plots", action="store_true", help="skip the PNG plots")
    _add(g, "--floor", help="floor to compare against (flash-next, qwen3-next-80b); default: from the model name")
    _add(g, "--only", help="all: just these benchmarks (comma-separated, e.g. agentic,idle), still one server")
    g = p.add_argument_group("workload (defaults are PERF.md's protocol)")
    _add(g, "--seed", type=int, default=0, help="seed of the deterministic filler text and tool results")
    _add(g, "--warmups", type=int, help="warm-up requests (default: decode 3, prefill 1)")
    _add(g, "--runs", type=int, help="measured runs (default: decode 5, prefill 3, experts 5, startup 1)")
    _add(g, "--max-tokens", type=int, default=1000, help="decode/experts: tokens generated per run (ignore_eos)")
    _add(g, "--depths", default="0", help="decode: context depths in tokens, e.g. 0,10000,65536")
    _add(g, "--lengths", default="10000,90000", help="prefill: prompt lengths in tokens")
    _add(g, "--scale", type=scale_value, default="auto",
         help="agentic: tool-result size factor (1 reaches ~35K tokens under Qwen's tokenizer); auto: the factor "
              "that gives the results as many tokens on the server's tokenizer (/tokenize) as under Qwen's")
    _add(g, "--tool-choice", default="required", help='agentic: tool_choice ("auto" for servers without "required")')
    _add(g, "--turn-tokens", type=int, default=256, help="agentic: max_tokens per turn")
    _add(g, "--conversations", type=int, default=8, help="idle: conversations kept")
    _add(g, "--conv-tokens", type=int, default=58000, help="idle: tokens per conversation")
    _add(g, "--churn-tokens", type=int, default=400000, help="idle: unrelated traffic in between, tokens")
    _add(g, "--cold-runs", type=int, default=1, help="idle: conversations also timed cold (fresh salt)")
    _add(g, "--restart", action="store_true",
         help="idle: stop and start the server between the churn and the resumes, so warm conversations can only "
              "come from the disk tier (--kv-disk-dir in --server-args); needs --model")
    _add(g, "--streams", default="1,2,4,8", help="concurrency: stream counts")
    _add(g, "--prompt-tokens", type=int, default=65536, help="concurrency: tokens per stream's prompt")
    _add(g, "--gen-tokens", type=int, default=256, help="concurrency: tokens generated per stream (ignore_eos)")
    _add(g, "--metrics-interval", type=float, default=0.5, help="experts: seconds between /metrics samples")
    return p


def add_bench_arguments(subparsers) -> argparse.ArgumentParser:
    """Adds `bench` with one subcommand per benchmark, `all` and `report`, to a CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmarks of PERF.md against our server or any OpenAI URL")
    inner = bench.add_subparsers(dest="bench", required=True, metavar="{" + ",".join([*BENCHES, "all", "report"]) + "}")
    flags = _bench_flags()
    for name, what in BENCHES.items():
        inner.add_parser(name, parents=[flags], help=what, description=what)
    inner.add_parser("all", parents=[flags], help="every benchmark in turn against one server")
    rep = inner.add_parser("report", help="markdown tables from results files")
    rep.add_argument("files", nargs="+", help="results JSON files")
    _add(rep, "--out", help="write the markdown here instead of stdout")
    bench.set_defaults(func=run_bench)
    return bench


def run_bench(args) -> int:
    try:
        if args.bench == "report":
            text = report.render(args.files)
            if args.out:
                Path(args.out).write_text(text)
            else:
                print(text)
            return 0
        return asyncio.run(_run(args))
    except BenchError as e:
        print(f"flashnext bench: {e}", file=sys.stderr)
        return 1


async def _run(args) -> int:
    commit_from_env()
    names = ALL if args.bench == "all" else [args.bench]
    if args.only:
        if args.bench != "all":
            raise BenchError("--only picks benchmarks for `flashnext bench all`; name one benchmark instead.")
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in ALL]
        if unknown or not wanted:
            raise BenchError(f"--only {args.only!r}: unknown benchmark {unknown[0] if unknown else '(none)'}; "
                             f"choose from {', '.join(ALL)}.")
        names = [n for n in ALL if n in wanted]
    if args.model is None and "startup" in names:
        if args.bench == "startup":
            raise BenchError("startup needs --model: it times our own server from process start.")
        names = [n for n in names if n != "startup"]
    if args.restart and args.url and "idle" in names:
        raise BenchError("--restart needs --model instead of --url: the bench can only restart a server it "
                         "started itself.")
    progress = Progress()
    tables, failed = [], []
    async with open_target(args) as target:
        if target.server is not None:
            progress.note(f"server up in {target.server.startup_s:.2f} s (log: {target.server.log_path})")
        for name in names:
            try:
                result, path, plots = await run_one(name, target, args, progress)
            except BenchError as e:
                if len(names) == 1:
                    raise
                # One benchmark the server cannot serve (a context too short, a missing feature) must not
                # cost the others their results in a long unattended run.
                progress.note(f"{name} failed: {e}")
                failed.append(name)
                continue
            progress.note(f"wrote {path}" + "".join(f"\nwrote {p}" for p in plots))
            tables.append(f"## {name}\n\n{bench_module(name).table(result)}\n")
    if target.server is not None and target.server.log_path:
        shutil.copy(target.server.log_path, Path(args.out_dir) / "last-server.log")
    print("\n".join(tables))
    if failed:
        print(f"flashnext bench: {', '.join(failed)} failed (see above)", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashnext")
    add_bench_arguments(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    if argv is not None:
        args.argv = ["flashnext", *argv]
    return args.func(args)
