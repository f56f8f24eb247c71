"""idle: do long conversations come back warm after unrelated traffic? Against a cold prefill.

With --restart the server we launched is stopped and started again between the churn and the resumes
(issue #9): then a warm conversation can only have come from the disk tier."""
from __future__ import annotations

from flashnext.bench import markdown as md
from flashnext.bench.plots import pyplot, save
from flashnext.bench.stats import summarize
from flashnext.bench.text import fresh_salt

REPLY_TOKENS = 16
WARM_FRACTION = 0.95  # PERF.md: warm when cached_tokens >= 95% of the conversation's history
QUESTION = "What is this text about? Answer in one sentence."
FOLLOW_UP = "Now list three questions that the text leaves open."


async def run(ctx):
    args = ctx.args
    samples, conversations = [], []
    for c in range(args.conversations):
        salt = fresh_salt()
        user = f"{salt}\n\n{ctx.sizer.filler(args.conv_tokens, seed=args.seed + 1000 + c)}\n\n{QUESTION}"
        r = await ctx.chat(f"idle fill {c + 1}/{args.conversations}:", [{"role": "user", "content": user}],
                           REPLY_TOKENS)
        samples.append(r.sample(phase="fill", conversation=c))
        conversations.append({"salt": salt, "history_tokens": r.prompt_tokens, "messages": [
            {"role": "user", "content": user}, {"role": "assistant", "content": r.content or "OK."},
            {"role": "user", "content": FOLLOW_UP}]})

    churned, k = 0, 0
    while churned < args.churn_tokens:
        size = min(args.conv_tokens, args.churn_tokens - churned)
        user = f"{fresh_salt()}\n\n{ctx.sizer.filler(size, seed=args.seed + 5000 + k)}\n\n{QUESTION}"
        r = await ctx.chat(f"idle churn {churned:,}/{args.churn_tokens:,} tokens:",
                           [{"role": "user", "content": user}], 1)
        samples.append(r.sample(phase="churn", request=k))
        churned += max(r.prompt_tokens or 0, 1)
        k += 1

    restart_s = None
    if args.restart:
        ctx.progress.start("idle restart:")
        restart_s = await ctx.target.server.restart()
        ctx.progress.done(f"server stopped and started again, up in {restart_s:.2f} s")
    for c, conv in enumerate(conversations):
        r = await ctx.chat(f"idle resume {c + 1}/{len(conversations)}:", conv["messages"], REPLY_TOKENS)
        samples.append(r.sample(phase="resume", conversation=c, history_tokens=conv["history_tokens"],
                                warm=_warm(r.cached_tokens, conv["history_tokens"])))
    for c, conv in enumerate(conversations[: args.cold_runs]):
        # The same prompt with a new salt: identical work, nothing cached.
        messages = [dict(m) for m in conv["messages"]]
        messages[0]["content"] = messages[0]["content"].replace(conv["salt"], fresh_salt(), 1)
        r = await ctx.chat(f"idle cold {c + 1}/{args.cold_runs}:", messages, REPLY_TOKENS)
        samples.append(r.sample(phase="cold", conversation=c, history_tokens=conv["history_tokens"]))
    return samples, {"churn_tokens": churned, "warm_fraction": WARM_FRACTION, "restarted": bool(args.restart),
                     "restart_startup_s": restart_s}


def _warm(cached: int | None, history: int | None) -> bool:
    return bool(cached and history and cached >= WARM_FRACTION * history)


def table(result: dict) -> str:
    resumes = [s for s in result["samples"] if s["phase"] == "resume"]
    cold = {s["conversation"]: s for s in result["samples"] if s["phase"] == "cold"}
    rows = [[s["conversation"] + 1, f"{s['history_tokens']:,}", md.num(s["cached_tokens"], 0),
             "warm" if s["warm"] else "cold", md.num(s["ttft_s"], 3),
             md.num(cold[s["conversation"]]["ttft_s"], 3) if s["conversation"] in cold else ""]
            for s in resumes]
    out = md.table(["conversation", "history tokens", "cached tokens", "came back", "TTFT s",
                    "cold prefill TTFT s"], rows)
    warm = summarize(s["ttft_s"] for s in resumes if s["warm"])
    cold_ttft = summarize(s["ttft_s"] for s in cold.values())["mean"]
    warm_ttft = f"warm TTFT {md.num(warm['min'], 3)}–{md.num(warm['max'], 3)} s" if warm["n"] else "none warm"
    info = result["info"]
    restart = (f" and after a server restart (up again in {md.num(info['restart_startup_s'], 2)} s)"
               if info.get("restarted") else "")
    out += (f"\n\n{warm['n']}/{len(resumes)} came back warm after {info['churn_tokens']:,} tokens of "
            f"other traffic{restart}; {warm_ttft}, cold prefill {md.num(cold_ttft, 3)} s.")
    return out


def plot(result: dict, stem) -> list:
    plt = pyplot()
    resumes = [s for s in result["samples"] if s["phase"] == "resume"]
    if plt is None or not resumes:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [s["conversation"] + 1 for s in resumes]
    ax.bar(xs, [s["ttft_s"] or 0 for s in resumes],
           color=["tab:green" if s["warm"] else "tab:red" for s in resumes])
    cold = summarize(s["ttft_s"] for s in result["samples"] if s["phase"] == "cold")["mean"]
    if cold == cold:  # not NaN
        ax.axhline(cold, color="grey", linestyle="--", label="cold prefill")
        ax.legend()
    ax.set_xticks(xs)
    ax.set_xlabel("conversation (green: warm, red: re-prefilled)")
    ax.set_ylabel("TTFT of the new turn (s)")
    restart = " and a server restart" if result["info"].get("restarted") else ""
    ax.set_title(f"idle conversations after other traffic{restart} — {result['model_id']}", fontsize=9)
    return [save(fig, stem.with_name(stem.name + "-ttft.png"))]
