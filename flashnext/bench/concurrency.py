"""concurrency: N parallel streams of distinct long prompts; per-stream (median) and aggregate tok/s.

Streams arrive together, so their prompts are prefilled one after another while the earlier ones decode: a stream's
own rate (first token to last) mixes decode steps with the prefill chunks of the others. Each stream's rate over
the span in which all N decode (from the last stream's first token to the first stream's end: `all_decoding_tok_s`)
is the batched decode rate alone; it is short when the prefills take long (at 8 × 64K on the H200, ~1 s of a 68 s
batch). So each group then continues its conversations (`phase` "resumed": the reply and one more user turn, as
agents come back): with a prefix cache the streams resume from their reply-end snapshots, skip the prefill and
decode together from their first tokens, and their own rates are the steady batched decode of N long streams.
"""
from __future__ import annotations

import asyncio
import time

from flashnext.bench import markdown as md
from flashnext.bench.decode import parse_ints
from flashnext.bench.plots import pyplot, save
from flashnext.bench.stats import median, summarize
from flashnext.bench.text import salted_prompt

QUESTION = "Retell the text above as a long story."
FOLLOW_UP = "Go on, and tell it again from another character's point of view."
WARMUPS = 1


async def run(ctx):
    args = ctx.args
    samples = []
    widest = max(parse_ints(args.streams))
    for i in range(ctx.count("warmups", WARMUPS)):
        # The widest batch once first: kernels compile and autotune for these shapes (tens of seconds the first
        # time), which would otherwise land in the first measured group.
        conversations = [_opening(ctx, args.seed + 7919 + 100 * i + j) for j in range(widest)]
        ctx.progress.start(f"concurrency warm-up {i + 1} ({widest} streams):")
        batch, _ = await _batch(ctx, conversations, "warmup")
        samples += batch
        ctx.progress.done("done")
    for n in parse_ints(args.streams):
        conversations = [_opening(ctx, args.seed + 100 * n + i) for i in range(n)]
        ctx.progress.start(f"concurrency {n} stream{'s' if n > 1 else ''}:")
        batch, replies = await _batch(ctx, conversations, "run")
        samples += batch
        ctx.progress.done(f"median {md.num(median(s['decode_tok_s'] for s in batch if s['decode_tok_s']))} "
                          f"tok/s per stream, aggregate {md.num(aggregate_rate(batch))} tok/s")
        ctx.progress.start(f"concurrency {n} stream{'s' if n > 1 else ''} resumed (one more turn each):")
        resumed, _ = await _batch(ctx, [conv + [{"role": "assistant", "content": reply or "OK."},
                                                {"role": "user", "content": FOLLOW_UP}]
                                        for conv, reply in zip(conversations, replies)], "resumed")
        samples += [dict(s, history_tokens=b["prompt_tokens"] + b["completion_tokens"]) for s, b in zip(resumed, batch)]
        ctx.progress.done(f"median {md.num(median(s['decode_tok_s'] for s in resumed if s['decode_tok_s']))} "
                          f"tok/s per stream")
    return samples, {}


def _opening(ctx, seed: int) -> list[dict]:
    return [{"role": "user", "content": salted_prompt(ctx.sizer, ctx.args.prompt_tokens, seed, QUESTION)}]


async def _batch(ctx, conversations: list[list[dict]], phase: str) -> tuple[list[dict], list[str]]:
    """All conversations at once → (their samples, their replies); the progress line counts the deltas of all
    streams together."""
    n, gen = len(conversations), ctx.args.gen_tokens
    deltas = [0] * n
    arrivals: list[list[float]] = [[] for _ in range(n)]   # each stream's delta times

    def counter(i):
        def update(count):
            deltas[i] = count
            arrivals[i].append(time.perf_counter())
            ctx.progress.update(f"{sum(deltas)}/{n * gen} deltas")
        return update

    rs = await asyncio.gather(*(ctx.target.client.chat(messages, gen, ignore_eos=True, on_delta=counter(i))
                                for i, messages in enumerate(conversations)))
    rates = all_decoding_rates(arrivals)
    return ([r.sample(phase=phase, streams=n, stream=i, all_decoding_tok_s=rate)
             for i, (r, rate) in enumerate(zip(rs, rates))], [r.content for r in rs])


def all_decoding_rates(arrivals: list[list[float]]) -> list[float | None]:
    """Each stream's deltas per second inside the span in which every stream decodes (from the latest first delta
    to the earliest last one), counting the deltas after the span's start; None for all when the spans do not
    overlap by at least two deltas of each stream (a stream finished before another's first token)."""
    if not arrivals or any(len(a) < 2 for a in arrivals):
        return [None] * len(arrivals)
    start, end = max(a[0] for a in arrivals), min(a[-1] for a in arrivals)
    counts = [sum(start < t <= end for t in a) for a in arrivals]
    if end <= start or min(counts) < 2:
        return [None] * len(arrivals)
    return [c / (end - start) for c in counts]


def aggregate_rate(batch: list[dict]) -> float | None:
    """All streams' completion tokens over the span in which they decoded: from the earliest first token
    to the latest end (prefill before it is left out, as in the single-stream rate)."""
    starts = [s["t_start"] + s["ttft_s"] for s in batch if s["ttft_s"] is not None]
    ends = [s["t_start"] + s["wall_s"] for s in batch]
    if not starts or max(ends) <= min(starts):
        return None
    return sum(s["completion_tokens"] or 0 for s in batch) / (max(ends) - min(starts))


def _groups(result, phase: str = "run"):
    out = {}
    for s in result["samples"]:
        if s["phase"] == phase:
            out.setdefault(s["streams"], []).append(s)
    return sorted(out.items())


def table(result: dict) -> str:
    rows = []
    for phase, label in (("run", "cold"), ("resumed", "resumed")):
        for n, batch in _groups(result, phase):
            rate = summarize(s["decode_tok_s"] for s in batch)
            steady = summarize(s.get("all_decoding_tok_s") for s in batch)
            rows.append([n, label, md.num(summarize(s["prompt_tokens"] for s in batch)["mean"], 0),
                         md.num(summarize(s["cached_tokens"] for s in batch)["mean"], 0),
                         md.num(rate["median"]), md.num(rate["min"]), md.num(rate["max"]),
                         md.num(aggregate_rate(batch)), md.num(steady["median"]),
                         md.num(steady["median"] * n if steady["n"] else None),
                         md.num(summarize(s["ttft_s"] for s in batch)["median"], 3)])
    return md.table(["streams", "prompts", "prompt tokens", "cached tokens", "per-stream tok/s median", "min", "max",
                     "aggregate tok/s", "per-stream tok/s while all decode", "aggregate then", "TTFT s median"], rows)


def plot(result: dict, stem) -> list:
    plt = pyplot()
    groups = _groups(result)
    if plt is None or not groups:
        return []
    ns = [n for n, _ in groups]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ns, [summarize(s["decode_tok_s"] for s in b)["median"] for _, b in groups], "o-",
            label="per stream (median)")
    ax.plot(ns, [aggregate_rate(b) or 0 for _, b in groups], "s--", label="aggregate")
    resumed = _groups(result, "resumed")
    if resumed:
        ax.plot([n for n, _ in resumed], [summarize(s["decode_tok_s"] for s in b)["median"] for _, b in resumed],
                "^-", label="per stream, resumed (prefix-cached)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"decode tok/s vs concurrency — {result['model_id']}", fontsize=9)
    return [save(fig, stem.with_name(stem.name + "-streams.png"))]
