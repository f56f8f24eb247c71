"""Runs benchmarks against a target: the shared context, the per-request progress line, the registry."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from flashnext.bench import results
from flashnext.bench.client import StreamResult
from flashnext.bench.progress import Progress, fmt
from flashnext.bench.target import Target
from flashnext.bench.text import TextSizer

# name -> (module, what it measures); each module has run(ctx), table(result) and plot(result, stem).
BENCHES = {
    "decode": "single-stream decode tok/s at context depths",
    "prefill": "prefill tok/s of salted long prompts",
    "agentic": "TTFT and cached tokens over a 12-turn tool-use session",
    "idle": "whether idle long conversations come back warm",
    "concurrency": "per-stream and aggregate decode tok/s of parallel long prompts",
    "experts": "decode tok/s and expert-cache hit rate, repeated vs varied prompts",
    "startup": "seconds to the first /health 200, and load GB/s",
}
# What `all` runs; startup only when we launched the server (its launch is the sample).
ALL = ["decode", "prefill", "agentic", "idle", "concurrency", "experts", "startup"]


def bench_module(name: str) -> ModuleType:
    return importlib.import_module(f"flashnext.bench.{name}")


@dataclass
class Context:
    target: Target
    args: object
    progress: Progress
    sizer: TextSizer

    def count(self, flag: str, protocol_default: int) -> int:
        """--warmups/--runs: the protocol's number for this benchmark unless the user set one."""
        value = getattr(self.args, flag)
        return protocol_default if value is None else value

    async def chat(self, label: str, messages: list[dict], max_tokens: int, **kw) -> StreamResult:
        """One request with a live progress line, ending in the line's summary."""
        self.progress.start(label)
        result = await self.target.client.chat(
            messages, max_tokens, on_delta=lambda n: self.progress.update(f"{n}/{max_tokens} deltas"), **kw)
        self.progress.done(describe(result))
        return result


def describe(r: StreamResult) -> str:
    return (f"ttft {fmt(r.ttft_s, 3)} s, {r.completion_tokens} tok, {fmt(r.decode_tok_s)} tok/s decode, "
            f"prompt {r.prompt_tokens} (cached {r.cached_tokens})")


async def run_bench(name: str, target: Target, args, progress: Progress) -> tuple[dict, Path, list[Path]]:
    """Run one benchmark, write its results file and plots; returns (result, json path, plot paths)."""
    module = bench_module(name)
    started = results.utc_now()
    sizer = await TextSizer.calibrate(target.client)
    progress.note(f"== {name}: {BENCHES[name]} ({target.model_id} at {target.url}; prompt sizes "
                  f"{'measured by /tokenize' if sizer.measured else 'estimated, the server has no /tokenize'})")
    samples, info = await module.run(Context(target, args, progress, sizer))
    info = {"sizes_measured": sizer.measured, "tokens_per_word": sizer.tokens_per_word, **info}
    result = results.build(name, target, args, samples, info, started)
    path = results.write(result, args.out_dir)
    plots = [] if args.no_plots else module.plot(result, path.with_suffix(""))
    return result, path, plots
