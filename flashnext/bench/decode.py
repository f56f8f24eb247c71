"""decode: single-stream decode tok/s = completion_tokens / (wall − TTFT), at several context depths."""
from __future__ import annotations

from flashnext.bench import markdown as md
from flashnext.bench.floors import floor_for
from flashnext.bench.plots import pyplot, save
from flashnext.bench.stats import summarize
from flashnext.bench.text import DECODE_PROMPTS

WARMUPS, RUNS = 3, 5


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in str(text).replace(" ", "").split(",") if x]


async def run(ctx):
    args = ctx.args
    samples, depth_info = [], {}
    for depth in parse_ints(args.depths):
        # The same filler for every run at a depth: after the first run the prefix cache may serve it,
        # which is fine since TTFT is taken out of the decode rate.
        filler = ctx.sizer.filler(depth, seed=args.seed + depth) if depth else ""
        depth_tokens, measured = await ctx.sizer.count(ctx.target.client, filler) if depth else (0, True)
        depth_info[str(depth)] = {"tokens": depth_tokens, "measured": measured}
        prompts = list(DECODE_PROMPTS.items())
        for i in range(ctx.count("warmups", WARMUPS)):
            name, prompt = prompts[i % len(prompts)]
            await _one(ctx, samples, "warmup", i, name, prompt, filler, depth, depth_tokens, measured)
        for i in range(ctx.count("runs", RUNS)):
            for name, prompt in prompts:
                await _one(ctx, samples, "run", i, name, prompt, filler, depth, depth_tokens, measured)
    return samples, {"depths": depth_info}


async def _one(ctx, samples, phase, i, name, prompt, filler, depth, depth_tokens, measured):
    content = f"{filler}\n\n{prompt}" if filler else prompt
    label = f"decode {phase} {i + 1} {name} depth {depth}:"
    r = await ctx.chat(label, [{"role": "user", "content": content}], ctx.args.max_tokens, ignore_eos=True)
    samples.append(r.sample(phase=phase, run=i, prompt=name, depth=depth, depth_tokens=depth_tokens,
                            depth_measured=measured))


def table(result: dict) -> str:
    floor = floor_for(result, "decode")
    rows = []
    runs = [s for s in result["samples"] if s["phase"] == "run"]
    for depth in sorted({s["depth"] for s in runs}):
        for name in DECODE_PROMPTS:
            group = [s for s in runs if s["depth"] == depth and s["prompt"] == name]
            if not group:
                continue
            rate = summarize(s["decode_tok_s"] for s in group)
            ttft = summarize(s["ttft_s"] for s in group)
            depth_tokens = f"{group[0]['depth_tokens']:,}" + ("" if group[0]["depth_measured"] else " (est.)")
            gen = summarize(s["completion_tokens"] for s in group)["mean"]
            rows.append([depth_tokens, name, len(group), md.num(gen, 0),
                         md.num(rate["mean"]), md.num(rate["min"]), md.num(rate["max"]), md.num(ttft["mean"], 3),
                         *md.vs_floor(rate["mean"], floor)])
    return md.table(["depth tokens", "prompt", "runs", "gen tokens", "decode tok/s mean", "min", "max",
                     "TTFT s", "floor tok/s", "of floor"], rows)


def plot(result: dict, stem) -> list:
    plt = pyplot()
    runs = [s for s in result["samples"] if s["phase"] == "run" and s["decode_tok_s"] is not None]
    if plt is None or not runs:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in DECODE_PROMPTS:
        depths = sorted({s["depth_tokens"] for s in runs if s["prompt"] == name})
        stats = [summarize(s["decode_tok_s"] for s in runs if s["prompt"] == name and s["depth_tokens"] == d)
                 for d in depths]
        if depths:
            ax.errorbar(depths, [x["mean"] for x in stats], marker="o", capsize=3, label=name,
                        yerr=[[x["mean"] - x["min"] for x in stats], [x["max"] - x["mean"] for x in stats]])
    floor = floor_for(result, "decode")
    if floor:
        ax.axhline(floor, color="grey", linestyle="--", label=f"floor {floor:.0f}")
    ax.set_xlabel("context depth (tokens)")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"decode tok/s vs depth — {result['model_id']}", fontsize=9)
    ax.legend()
    return [save(fig, stem.with_name(stem.name + "-depth.png"))]
