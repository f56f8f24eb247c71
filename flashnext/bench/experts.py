"""experts: decode tok/s and expert-cache hit rate (the server's /metrics) on repeated and varied prompts.

Run it twice, with an expert VRAM budget and all-resident (server flags), to compare. Random weights route
uniformly: the worst case for a cache, so say so beside any number from a synthetic checkpoint.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import time

from flashnext.bench import markdown as md
from flashnext.bench.plots import pyplot, save
from flashnext.bench.stats import summarize
from flashnext.bench.text import ESSAY_PROMPT, varied_text

METRICS = {"hits": "flashnext_expert_cache_hits_total", "misses": "flashnext_expert_cache_misses_total",
           "bytes_copied": "flashnext_expert_cache_bytes_copied_total",
           "stall_seconds": "flashnext_expert_cache_stall_seconds_total",
           "prefetched": "flashnext_expert_cache_prefetched_total",
           "prefetch_used": "flashnext_expert_cache_prefetch_used_total",
           "admitted": "flashnext_expert_cache_admitted_total"}
RUNS = 5
_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str | None) -> dict[str, float]:
    """Our expert-cache counters from Prometheus text, summed over labels; absent names are left out."""
    found: dict[str, float] = {}
    for line in (text or "").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        for key, name in METRICS.items():
            if m.group(1) == name:
                with contextlib.suppress(ValueError):
                    found[key] = found.get(key, 0.0) + float(m.group(3))
    return found


def hit_rate(hits: float | None, misses: float | None) -> float | None:
    if hits is None or misses is None or hits + misses == 0:
        return None
    return hits / (hits + misses)


async def run(ctx):
    args, client = ctx.args, ctx.target.client
    timeline: list[dict] = []
    t0 = time.time()

    async def poll():
        while True:
            timeline.append({"t": time.time() - t0, **parse_metrics(await client.get_text("/metrics"))})
            await asyncio.sleep(args.metrics_interval)

    poller = asyncio.create_task(poll())
    samples = []
    try:
        runs = ctx.count("runs", RUNS)
        for traffic in ("repeated", "varied"):
            for i in range(runs):
                prompt = ESSAY_PROMPT if traffic == "repeated" else (
                    f"Continue this story in your own words:\n\n{varied_text(150, seed=args.seed + 7000 + i)}")
                before = parse_metrics(await client.get_text("/metrics"))
                r = await ctx.chat(f"experts {traffic} {i + 1}/{runs}:", [{"role": "user", "content": prompt}],
                                   args.max_tokens, ignore_eos=True)
                after = parse_metrics(await client.get_text("/metrics"))
                delta = {k: after[k] - before[k] for k in METRICS if k in after and k in before}
                samples.append(r.sample(phase="run", traffic=traffic, run=i, t_rel=r.t_start - t0, **delta,
                                        hit_rate=hit_rate(delta.get("hits"), delta.get("misses"))))
    finally:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
    available = any(k in point for point in timeline for k in METRICS)
    if not available:
        ctx.progress.note("experts: the server's /metrics has no flashnext_expert_cache_* counters: hit rate n/a")
    return samples, {"metrics_available": available, "timeline": timeline}


def table(result: dict) -> str:
    rows = []
    for traffic in ("repeated", "varied"):
        group = [s for s in result["samples"] if s["traffic"] == traffic]
        if not group:
            continue
        rate = summarize(s["decode_tok_s"] for s in group)
        total = lambda key: sum(s[key] for s in group) if all(key in s for s in group) else None  # noqa: E731
        hits, misses, copied, stall, prefetched, used, admitted = (
            total(k) for k in ("hits", "misses", "bytes_copied", "stall_seconds", "prefetched", "prefetch_used",
                               "admitted"))
        tokens = sum(s["completion_tokens"] or 0 for s in group)
        hr = hit_rate(hits, misses)
        rows.append([traffic, len(group), md.num(rate["mean"]), md.num(rate["min"]), md.num(rate["max"]),
                     "n/a" if hr is None else f"{100 * hr:.1f}%", md.num(None if copied is None else copied / 1e9, 2),
                     md.num(None if stall is None or not tokens else 1e3 * stall / tokens, 3),
                     "n/a" if prefetched is None else f"{prefetched:.0f} ({used or 0:.0f} used)",
                     md.num(None if admitted is None or not tokens else admitted / tokens, 1)])
    return md.table(["traffic", "runs", "decode tok/s mean", "min", "max", "expert hit rate", "GB copied",
                     "stall ms/token", "prefetched (used)", "admitted in step / token"], rows)


def plot(result: dict, stem) -> list:
    """Hit rate between consecutive /metrics samples as a line, and each request's own as a dot."""
    plt = pyplot()
    per_run = [s for s in result["samples"] if s.get("hit_rate") is not None]
    if plt is None or not per_run:
        return []
    timeline = [p for p in result["info"].get("timeline", []) if "hits" in p and "misses" in p]
    ts, rates = [], []
    for a, b in zip(timeline, timeline[1:]):
        rate = hit_rate(b["hits"] - a["hits"], b["misses"] - a["misses"])
        if rate is not None:
            ts.append(b["t"])
            rates.append(100 * rate)
    fig, ax = plt.subplots(figsize=(7, 4))
    if ts:
        ax.plot(ts, rates, "-", linewidth=1, color="tab:blue", label="between /metrics samples")
    for traffic, color in (("repeated", "tab:green"), ("varied", "tab:orange")):
        group = [s for s in per_run if s["traffic"] == traffic]
        ax.plot([s["t_rel"] + s["wall_s"] / 2 for s in group], [100 * s["hit_rate"] for s in group], "o",
                color=color, label=f"{traffic} prompts, per request")
    ax.legend(fontsize=8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("expert-cache hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"expert-cache hit rate over time — {result['model_id']}", fontsize=9)
    return [save(fig, stem.with_name(stem.name + "-hits.png"))]
