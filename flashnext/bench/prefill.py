"""prefill: prefill tok/s = prompt_tokens / TTFT of long prompts that start with a fresh random salt."""
from __future__ import annotations

from flashnext.bench import markdown as md
from flashnext.bench.decode import parse_ints
from flashnext.bench.floors import floor_for
from flashnext.bench.stats import prefill_rate, summarize
from flashnext.bench.text import fresh_salt

WARMUPS, RUNS = 1, 3
MAX_TOKENS = 16
QUESTION = "Summarize the text above in one sentence."


async def run(ctx):
    samples = []
    for length in parse_ints(ctx.args.lengths):
        body = f"{ctx.sizer.filler(length, seed=ctx.args.seed + length)}\n\n{QUESTION}"
        plan = [("warmup", i) for i in range(ctx.count("warmups", WARMUPS))]
        plan += [("run", i) for i in range(ctx.count("runs", RUNS))]
        for phase, i in plan:
            # A new salt in front of the same text: no prefix of this prompt was ever seen.
            messages = [{"role": "user", "content": f"{fresh_salt()}\n\n{body}"}]
            r = await ctx.chat(f"prefill {phase} {i + 1} length {length}:", messages, MAX_TOKENS)
            samples.append(r.sample(phase=phase, run=i, length=length,
                                    prefill_tok_s=prefill_rate(r.prompt_tokens or 0, r.ttft_s)))
    return samples, {}


def table(result: dict) -> str:
    floor = floor_for(result, "prefill")
    runs = [s for s in result["samples"] if s["phase"] == "run"]
    rows = []
    for length in sorted({s["length"] for s in runs}):
        group = [s for s in runs if s["length"] == length]
        rate = summarize(s["prefill_tok_s"] for s in group)
        rows.append([f"{length:,}", md.num(summarize(s["prompt_tokens"] for s in group)["mean"], 0), len(group),
                     md.num(rate["mean"], 0), md.num(rate["min"], 0), md.num(rate["max"], 0),
                     md.num(summarize(s["ttft_s"] for s in group)["mean"], 3),
                     md.num(summarize(s["cached_tokens"] for s in group)["max"], 0),
                     *md.vs_floor(rate["mean"], floor)])
    return md.table(["target tokens", "prompt tokens", "runs", "prefill tok/s mean", "min", "max", "TTFT s",
                     "max cached", "floor tok/s", "of floor"], rows)


def plot(result: dict, stem) -> list:
    return []  # two or three lengths read better as the table
