"""concurrency: N parallel streams of distinct long prompts; per-stream (median) and aggregate tok/s."""
from __future__ import annotations

import asyncio

from flashnext.bench import markdown as md
from flashnext.bench.decode import parse_ints
from flashnext.bench.plots import pyplot, save
from flashnext.bench.stats import median, summarize
from flashnext.bench.text import salted_prompt

QUESTION = "Retell the text above as a long story."
WARMUPS = 1


async def run(ctx):
    args = ctx.args
    samples = []
    widest = max(parse_ints(args.streams))
    for i in range(ctx.count("warmups", WARMUPS)):
        # The widest batch once first: kernels compile and autotune for these shapes (tens of seconds the first
        # time), which would otherwise land in the first measured group.
        prompts = [salted_prompt(ctx.sizer, args.prompt_tokens, args.seed + 7919 + 100 * i + j, QUESTION)
                   for j in range(widest)]
        ctx.progress.start(f"concurrency warm-up {i + 1} ({widest} streams):")
        samples += [dict(s, phase="warmup") for s in await _batch(ctx, prompts)]
        ctx.progress.done("done")
    for n in parse_ints(args.streams):
        prompts = [salted_prompt(ctx.sizer, args.prompt_tokens, args.seed + 100 * n + i, QUESTION) for i in range(n)]
        ctx.progress.start(f"concurrency {n} stream{'s' if n > 1 else ''}:")
        batch = await _batch(ctx, prompts)
        samples += batch
        ctx.progress.done(f"median {md.num(median(s['decode_tok_s'] for s in batch if s['decode_tok_s']))} "
                          f"tok/s per stream, aggregate {md.num(aggregate_rate(batch))} tok/s")
    return samples, {}


async def _batch(ctx, prompts: list[str]) -> list[dict]:
    """All prompts at once; the progress line counts the deltas of all streams together."""
    n, gen = len(prompts), ctx.args.gen_tokens
    deltas = [0] * n

    def counter(i):
        def update(count):
            deltas[i] = count
            ctx.progress.update(f"{sum(deltas)}/{n * gen} deltas")
        return update

    rs = await asyncio.gather(*(ctx.target.client.chat([{"role": "user", "content": p}], gen, ignore_eos=True,
                                                       on_delta=counter(i)) for i, p in enumerate(prompts)))
    return [r.sample(phase="run", streams=n, stream=i) for i, r in enumerate(rs)]


def aggregate_rate(batch: list[dict]) -> float | None:
    """All streams' completion tokens over the span in which they decoded: from the earliest first token
    to the latest end (prefill before it is left out, as in the single-stream rate)."""
    starts = [s["t_start"] + s["ttft_s"] for s in batch if s["ttft_s"] is not None]
    ends = [s["t_start"] + s["wall_s"] for s in batch]
    if not starts or max(ends) <= min(starts):
        return None
    return sum(s["completion_tokens"] or 0 for s in batch) / (max(ends) - min(starts))


def _groups(result):
    out = {}
    for s in result["samples"]:
        if s["phase"] == "run":
            out.setdefault(s["streams"], []).append(s)
    return sorted(out.items())


def table(result: dict) -> str:
    rows = []
    for n, batch in _groups(result):
        rate = summarize(s["decode_tok_s"] for s in batch)
        rows.append([n, md.num(summarize(s["prompt_tokens"] for s in batch)["mean"], 0),
                     md.num(rate["median"]), md.num(rate["min"]), md.num(rate["max"]),
                     md.num(aggregate_rate(batch)), md.num(summarize(s["ttft_s"] for s in batch)["median"], 3)])
    return md.table(["streams", "prompt tokens", "per-stream tok/s median", "min", "max", "aggregate tok/s",
                     "TTFT s median"], rows)


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
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"decode tok/s vs concurrency — {result['model_id']}", fontsize=9)
    return [save(fig, stem.with_name(stem.name + "-streams.png"))]
