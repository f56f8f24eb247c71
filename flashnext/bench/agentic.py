"""agentic: per-turn TTFT and cached tokens over a 12-turn tool-use session; headline = turn-12 TTFT."""
from __future__ import annotations

import sys

from flashnext.bench import agentic_session as session
from flashnext.bench.client import BenchError
from flashnext.bench import markdown as md
from flashnext.bench.plots import pyplot, save
from flashnext.bench.text import fresh_salt
from flashnext.bench.tools import TOOLS


async def run(ctx):
    args = ctx.args
    scale, bytes_per_token = args.scale, None
    if scale == "auto":
        results = session.results_text(args.seed)
        tokens, measured = await ctx.sizer.count(ctx.target.client, results)
        if measured and tokens:
            bytes_per_token = len(results.encode()) / tokens
        scale = session.auto_scale(bytes_per_token)
    messages = session.opening_messages()
    # A salt in the user's task (not the system prompt): a new session shares the agent's system
    # prompt and tools with earlier ones, as real sessions do, and nothing after that.
    messages[1]["content"] = f"{fresh_salt()} {messages[1]['content']}"
    samples, stopped = [], None
    for turn in range(session.TURNS):
        try:
            r = await ctx.chat(f"agentic turn {turn + 1}/{session.TURNS}:", messages, args.turn_tokens,
                               tools=TOOLS, tool_choice=args.tool_choice)
        except BenchError as e:
            # A server whose context is shorter than the session ends it here; the turns so far still count.
            if "context_length_exceeded" not in str(e):
                raise
            stopped = {"turn": turn + 1, "reason": str(e)}
            print(f"agentic: turn {turn + 1} does not fit the server's context; stopping the session there",
                  file=sys.stderr)
            break
        model_call = session.usable_call(r.tool_calls)
        call = model_call or session.scripted_call(turn)
        samples.append(r.sample(phase="run", turn=turn + 1, estimated_prompt_tokens=session.estimated_tokens(messages),
                                call_source="model" if model_call else "scripted", tool=call["function"]["name"],
                                result_bytes=session.result_size(session.STEPS[turn], scale)))
        session.append_turn(messages, turn, call, args.seed, scale)
    return samples, {"turns": session.TURNS, "scale": scale, "scale_flag": args.scale,
                     "result_bytes_per_token": bytes_per_token, "tool_choice": args.tool_choice, "stopped": stopped}


def headline(result: dict) -> dict | None:
    last = [s for s in result["samples"] if s["turn"] == session.TURNS]
    return last[-1] if last else None


def table(result: dict) -> str:
    rows = [[s["turn"], f"{s['prompt_tokens']:,}", md.num(s["cached_tokens"], 0),
             md.num(s["ttft_s"], 3), md.num(s.get("first_chunk_s"), 3), s["tool"], s["call_source"],
             f"{s['result_bytes']:,}"]
            for s in result["samples"]]
    out = md.table(["turn", "prompt tokens", "cached tokens", "TTFT s", "first chunk s", "tool call", "call from",
                    "result bytes"], rows)
    info = result.get("info", {})
    if info.get("scale_flag") == "auto":
        per_token = info.get("result_bytes_per_token")
        out += (f"\n\nTool results at scale {info['scale']} (auto: "
                + (f"{per_token:.2f} bytes a token on this server's tokenizer, {session.BYTES_PER_TOKEN} under Qwen's)"
                   if per_token else "the server has no /tokenize)"))
    last = headline(result)
    if last:
        out += (f"\n\nHeadline: turn-{last['turn']} TTFT {md.num(last['ttft_s'], 3)} s at "
                f"{last['prompt_tokens']:,} prompt tokens ({md.num(last['cached_tokens'], 0)} cached)")
        if last.get("first_chunk_s") is not None:
            out += (f"; first chunk {md.num(last['first_chunk_s'], 3)} s (the first token where the server opens a "
                    "choice with it; TTFT waits for a tool call's first fragment, which a server may hold until the "
                    "call is whole)")
        out += "."
    return out


def plot(result: dict, stem) -> list:
    plt = pyplot()
    samples = result["samples"]
    if plt is None or not samples:
        return []
    turns = [s["turn"] for s in samples]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(turns, [s["ttft_s"] or 0 for s in samples], color="tab:blue", label="TTFT")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (s)")
    ax.set_xticks(turns)
    twin = ax.twinx()
    twin.plot(turns, [s["prompt_tokens"] for s in samples], "k-o", markersize=3, label="prompt tokens")
    twin.plot(turns, [s["cached_tokens"] or 0 for s in samples], "g--o", markersize=3, label="cached tokens")
    twin.set_ylabel("tokens")
    twin.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    twin.legend(handles=handles, loc="upper left", fontsize=8)
    ax.set_title(f"agentic session: TTFT per turn — {result['model_id']}", fontsize=9)
    return [save(fig, stem.with_name(stem.name + "-ttft.png"))]
