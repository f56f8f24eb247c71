"""The scripted 12-turn coding session of the agentic benchmark: tool calls and realistic tool results.

Every result is generated from (seed, turn) to an exact byte size, so the history grows the same way on
every run and every server; `scale` shrinks the sizes for quick runs, or (`auto_scale`) sizes them so that their
tokens on the server's tokenizer are those of a real one.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from flashnext.bench.text import varied_text
from flashnext.bench.tools import SYSTEM_PROMPT, TOOLS, USER_TASK

# Bytes per token of code, logs and markdown under Qwen's tokenizer: the history size estimate, and what
# --scale auto sizes the tool results to on the server's tokenizer.
BYTES_PER_TOKEN = 3.4
MIN_RESULT_BYTES = 40  # the floor of a scaled-down result, so that even tiny runs carry real text


@dataclass(frozen=True)
class Step:
    tool: str
    arguments: dict
    kind: str          # which generator makes the result
    size: int          # bytes of the result at scale 1 (PERF.md: 300 B – 35 KB)


PAGINATION = "src/ledgerline/pagination.py"
STEPS: list[Step] = [
    Step("todo_write", {"todos": [
        {"id": "1", "content": "Reproduce the failing pagination test", "status": "in_progress"},
        {"id": "2", "content": "Find why an entry is skipped between pages", "status": "pending"},
        {"id": "3", "content": "Fix and run the whole suite", "status": "pending"}]}, "todo", 300),
    Step("ls", {"path": "src/ledgerline"}, "ls", 1_400),
    Step("grep", {"pattern": "next_cursor|paginate", "path": "src", "output_mode": "content"}, "grep", 3_600),
    Step("read", {"path": PAGINATION}, "file", 9_800),
    Step("bash", {"command": "python -m pytest tests/test_pagination.py -x -q",
                  "description": "Run the pagination tests"}, "pytest", 6_500),
    Step("read", {"path": "tests/test_pagination.py"}, "file", 7_400),
    Step("web_search", {"query": "keyset pagination cursor off by one inclusive exclusive boundary"},
         "search", 2_600),
    Step("web_fetch", {"url": "https://use-the-index-luke.com/no-offset",
                       "prompt": "How should the cursor boundary be compared?"}, "page", 21_000),
    Step("edit", {"path": PAGINATION, "old_string": "    query = query.where(Entry.id >= cursor)",
                  "new_string": "    query = query.where(Entry.id > cursor)"}, "edit", 420),
    Step("bash", {"command": "python -m pytest -q", "description": "Run the whole test suite"}, "pytest", 35_000),
    Step("read", {"path": "src/ledgerline/api/routes.py", "offset": 1, "limit": 400}, "file", 15_500),
    Step("bash", {"command": "git diff --stat && git diff", "description": "Review the change"}, "diff", 1_800),
]
TURNS = len(STEPS)


def auto_scale(bytes_per_token: float | None) -> float:
    """The scale at which the tool results take as many tokens on this server as at scale 1 under Qwen's tokenizer
    (BYTES_PER_TOKEN): the protocol's ~35K tokens at turn 12 (PERF.md). `bytes_per_token`: the results' (results_text)
    on the server's tokenizer, None without /tokenize (scale 1). A synthetic tokenizer spends about twice Qwen's
    tokens on them (the full-size synthetic Flash-Next reached 66K tokens at turn 12 at scale 1)."""
    return 1.0 if not bytes_per_token else round(bytes_per_token / BYTES_PER_TOKEN, 3)


def results_text(seed: int) -> str:
    """Every turn's tool result at scale 1, one after another (what auto_scale has the server count)."""
    return "\n".join(tool_result(turn, seed) for turn in range(TURNS))


def result_size(step: Step, scale: float) -> int:
    return max(MIN_RESULT_BYTES, round(step.size * scale))


def tool_result(turn: int, seed: int, scale: float = 1.0) -> str:
    """The result of the scripted call of `turn` (0-based), exactly `result_size` bytes of ASCII."""
    step = STEPS[turn]
    rng = random.Random(seed * 1000 + turn)
    size = result_size(step, scale)
    text = _GENERATORS[step.kind](rng, step.arguments, size)
    while len(text) < size:  # generators aim a little high; pad the rare short one with more of itself
        text += "\n" + _GENERATORS[step.kind](rng, step.arguments, size)
    return text[:size]


def scripted_call(turn: int) -> dict:
    step = STEPS[turn]
    return {"id": f"call_{turn + 1:02d}", "type": "function",
            "function": {"name": step.tool, "arguments": json.dumps(step.arguments)}}


def usable_call(calls: list[dict]) -> dict | None:
    """The model's first tool call if it names one of our tools with JSON-object arguments."""
    names = {t["function"]["name"] for t in TOOLS}
    for call in calls:
        fn = call.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "")
        except ValueError:
            continue
        if fn.get("name") in names and isinstance(args, dict):
            return {"id": call.get("id") or "call_model", "type": "function",
                    "function": {"name": fn["name"], "arguments": json.dumps(args)}}
    return None


def opening_messages() -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": USER_TASK}]


def append_turn(messages: list[dict], turn: int, call: dict, seed: int, scale: float) -> None:
    """The assistant's tool call of `turn` and the tool's answer, as a client would send them back."""
    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(turn, seed, scale)})


def estimated_tokens(messages: list[dict]) -> int:
    """A tokenizer-free size estimate of a conversation (tool schemas included)."""
    size = len(json.dumps(TOOLS)) + sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", "")))
                                        for m in messages)
    return round(size / BYTES_PER_TOKEN)


# --- result generators: (rng, arguments, size in bytes) -> text a little longer than size -------------

_WORDS = ["entry", "cursor", "ledger", "account", "page", "limit", "balance", "posting", "journal", "amount",
          "currency", "store", "session", "query", "row", "batch", "snapshot", "offset", "token", "record"]
_MODULES = ["pagination", "accounts", "entries", "store", "money", "api/routes", "api/schemas", "cli",
            "journal", "reports", "auth", "settings", "migrations/0007_cursor", "errors", "clock"]


def _ident(rng: random.Random, n: int = 2) -> str:
    return "_".join(rng.choice(_WORDS) for _ in range(n))


def _code_lines(rng: random.Random, size: int):
    while True:
        name = _ident(rng, rng.randint(2, 3))
        args = ", ".join(_ident(rng, 1) for _ in range(rng.randint(1, 3)))
        yield f"def {name}({args}) -> {rng.choice(['int', 'str', 'list[Entry]', 'Page', 'None'])}:"
        yield f'    """{varied_text(rng.randint(6, 14), rng.randint(0, 10**6)).rstrip(".")}."""'
        for _ in range(rng.randint(3, 9)):
            a, b = _ident(rng, 1), _ident(rng)
            yield rng.choice([
                f"    {a} = {b}({rng.randint(0, 500)})",
                f"    if {a} is None or {a}.{_ident(rng, 1)} >= {rng.randint(1, 99)}:",
                f"        raise ValueError(f\"bad {a}: {{{a}!r}}\")",
                f"    query = query.where(Entry.{_ident(rng, 1)} >= {a}).limit({b})",
                f"    for {a} in {b}:",
                f"        {a}.{_ident(rng, 1)} += {rng.randint(1, 9)}",
                f"    return {b}({a}, limit={rng.randint(10, 200)})",
            ])
        yield ""


def _file(rng, args, size):
    lines, out, n = _code_lines(rng, size), [], 0
    while n < size:
        out.append(f"{len(out) + 1:6d}\t{next(lines)}")
        n += len(out[-1]) + 1
    return "\n".join(out)


def _grep(rng, args, size):
    out, n = [], 0
    while n < size:
        line = f"src/ledgerline/{rng.choice(_MODULES)}.py:{rng.randint(1, 900)}:    {_ident(rng)} = " \
               f"paginate({_ident(rng, 1)}, next_cursor={_ident(rng, 1)})"
        out.append(line)
        n += len(line) + 1
    return "\n".join(out)


def _pytest(rng, args, size):
    out = ["============================= test session starts ==============================",
           "platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0", "rootdir: /workspace/ledgerline"]
    n = sum(len(x) + 1 for x in out)
    while n < size:
        if rng.random() < 0.7:
            line = f"tests/test_{rng.choice(_MODULES).split('/')[-1]}.py " + "".join(
                rng.choice("....F.s") for _ in range(rng.randint(8, 60)))
        else:
            line = (f"E       AssertionError: assert {rng.randint(1, 300)} == {rng.randint(1, 300)}\n"
                    f"E        +  where {rng.randint(1, 300)} = len(page.{_ident(rng, 1)})\n"
                    f"src/ledgerline/{rng.choice(_MODULES)}.py:{rng.randint(1, 400)}: AssertionError")
        out.append(line)
        n += len(line) + 1
    out.append(f"=== {rng.randint(1, 5)} failed, {rng.randint(200, 900)} passed in {rng.uniform(2, 40):.2f}s ===")
    return "\n".join(out)


def _ls(rng, args, size):
    out, n = [], 0
    while n < size:
        name = rng.choice(_MODULES).split("/")[-1] + rng.choice([".py", ".py", "/", ".md", ".toml", ".json"])
        out.append(f"{rng.randint(120, 48000):>8}  {name}")
        n += len(out[-1]) + 1
    return "\n".join(out)


def _search(rng, args, size):
    out, n = [], 0
    while n < size:
        block = (f"## {varied_text(rng.randint(4, 8), rng.randint(0, 10**6)).rstrip('.')}\n"
                 f"https://{rng.choice(['docs', 'blog', 'wiki', 'forum'])}.example.org/{_ident(rng)}\n"
                 f"{varied_text(rng.randint(25, 45), rng.randint(0, 10**6))}\n")
        out.append(block)
        n += len(block) + 1
    return "\n".join(out)


def _page(rng, args, size):
    out, n = [], 0
    while n < size:
        block = varied_text(rng.randint(60, 140), rng.randint(0, 10**6))
        if rng.random() < 0.3:
            block += "\n\n```sql\nSELECT * FROM entries WHERE id > :cursor ORDER BY id LIMIT :limit;\n```"
        out.append(block)
        n += len(block) + 2
    return "\n\n".join(out)


def _todo(rng, args, size):
    return json.dumps({"ok": True, "todos": args.get("todos", [])}, indent=2) + "\n" * size


def _edit(rng, args, size):
    head = f"Applied 1 edit to {args['path']}.\n"
    return head + "\n".join(_file(rng, args, size - len(head)).splitlines()[:12])


def _diff(rng, args, size):
    head = (f" {args.get('path', PAGINATION)} | 2 +-\n 1 file changed, 1 insertion(+), 1 deletion(-)\n"
            f"diff --git a/{PAGINATION} b/{PAGINATION}\n--- a/{PAGINATION}\n+++ b/{PAGINATION}\n")
    return head + "\n".join(("+" if rng.random() < 0.1 else " ") + line.split("\t", 1)[-1]
                            for line in _file(rng, args, size).splitlines())


_GENERATORS = {"file": _file, "grep": _grep, "pytest": _pytest, "ls": _ls, "search": _search, "page": _page,
               "todo": _todo, "edit": _edit, "diff": _diff}
