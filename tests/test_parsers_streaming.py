"""Streaming: whatever the chunking, the deltas add up to the non-streamed parse, and text is emitted as
soon as it cannot be the start of a tag."""
import json
import random
import re

import pytest

from flashnext.server.parsers import (ChatOutputParser, ContentDelta, ReasoningDelta, ToolCallArguments,
                                      ToolCallStart, collect, get_tool_parser)
from flashnext.server.parsers.qwen3_coder import MAX_NAME_LEN

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                         "overwrite": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "run_shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout_s": {"type": "number"},
                                         "env": {"type": "object"}}}}},
]
CODE = ('import math\n\n\ndef area(r: float) -> float:\n    """π·r² — with «unicode»."""\n'
        '    return math.pi * r ** 2\n')

HERMES_QWEN3 = (
    "<think>\nThe user wants the weather in Zürich and a file written. The format is <tool_call> with JSON.\n"
    "</think>\n\nI'll check the weather and save the helper.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n</tool_call>\n<tool_call>\n'
    + json.dumps({"name": "write_file", "arguments": {"path": "geo/圆.py", "content": CODE, "overwrite": True}},
                 ensure_ascii=False)
    + "\n</tool_call>\n<tool_call>\n"
    '{"name": "run_shell", "arguments": {"command": "python -c \\"print(1<2)\\" && echo \'</tool_call>\'", '
    '"timeout_s": 2.5, "env": {"NESTED": {"list": [1, -2.0e3, true, false, null, "\\u00e9"]}}}}\n</tool_call>')


def rejected_late(fmt, n):
    """A write_file call whose content holds n more openings of a call, each of which, read as a call, would
    run to the text's end too; the outer call is rejected only there (junk where `</tool_call>` belongs)."""
    if fmt == "qwen3_coder":
        opening = "<tool_call>\n<function=write_file>\n<parameter=content>\n"
        return opening + (opening + "x ") * n + "\n</parameter>\n" * (n + 1) + "</function>\njunk"
    return ('<tool_call>{"name": "write_file", "arguments": {"content": "' + '<tool_call>{\\"x ' * n
            + '"}}\njunk')


CODER_FLASH_NEXT = (  # starts_in_reasoning: the template opened <think>
    "Need to write area() then test it. I shouldn't write <tool_call> in prose.\n</think>\n\n"
    "Writing the module.\n\n<tool_call>\n<function=write_file>\n<parameter=path>\ngeo/circle.py\n</parameter>\n"
    f"<parameter=content>\n{CODE}\n</parameter>\n<parameter=overwrite>\nfalse\n</parameter>\n</function>\n"
    "</tool_call>\n<tool_call>\n<function=run_shell>\n<parameter=command>\npython -m pytest -q -k 'area'\n"
    "</parameter>\n<parameter=timeout_s>\n90.5\n</parameter>\n<parameter=env>\n{\"LANG\": \"C.UTF-8\"}\n"
    "</parameter>\n</function>\n</tool_call>\nDone — both calls issued.")

SAMPLES = [
    ("hermes", HERMES_QWEN3, {}),
    ("qwen3_coder", CODER_FLASH_NEXT, {"starts_in_reasoning": True}),
    ("qwen3_coder", "<think>\nplan</think>Short answer, no tools. Ünïcödé ✓ <b>bold</b> a<b", {}),
    ("hermes", HERMES_QWEN3, {"reasoning": False}),
    # malformed: each must stream exactly like its non-streamed parse
    ("hermes", 'Calling.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', {}),
    ("hermes", "<tool_call>\n{'name': 'get_weather'}\n</tool_call>\nsorry<tool_call", {}),
    ("hermes", '<tool_call><tool_call>{"name": "get_weather", "arguments": {}}</tool_call></tool_call>', {}),
    ("hermes", '<tool_call>{"name": "nope", "arguments": {}}</tool_call> <tool_call>{"name"}', {}),
    ("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=content>\nunterminated </paramet", {}),
    ("qwen3_coder", "x <tool_call>\n<function=nope>\n</function>\n</tool_call><tool_call>\n<function=get_weather"
                    ">\n<parameter=city>\nOslo\n</parameter>\n</tool_call>tail", {}),
    ("qwen3_coder", "<tool_call>\n<function=get_weather\n<parameter=city>", {"reasoning": False}),
    # then a call that is a call: only the text after where the scanner decided is scanned again
    ("qwen3_coder", rejected_late("qwen3_coder", 3) + "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                    "Oslo\n</parameter>\n</tool_call>", {}),
    ("hermes", rejected_late("hermes", 3) + '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', {}),
]
SAMPLE_IDS = ["hermes-qwen3", "coder-flash-next", "no-tools-used", "hermes-thinking-off", "hermes-truncated",
              "hermes-python-dict", "hermes-nested-tags", "hermes-unknown-name", "coder-truncated-value",
              "coder-unknown-then-forgiven", "coder-broken-name", "coder-rejected-late",
              "hermes-rejected-late"]
ID = re.compile(r"^call_[A-Za-z0-9]{24}$")


def stream(fmt, pieces, truncated=False, **kw):
    parser = ChatOutputParser(fmt, TOOLS, **kw)
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish(truncated)
    return deltas, parser


def comparable(msg):
    return msg.content, msg.reasoning, [(c.name, c.arguments) for c in msg.tool_calls]


def check_call_deltas(deltas):
    """id/type/name only in a call's first fragment; its fragments concatenate to its JSON arguments."""
    starts = [d for d in deltas if isinstance(d, ToolCallStart)]
    assert [d.index for d in starts] == list(range(len(starts)))
    assert all(ID.match(d.id) and d.type == "function" for d in starts)
    assert len({d.id for d in starts}) == len(starts)
    seen = set()
    for d in deltas:
        if isinstance(d, ToolCallStart):
            seen.add(d.index)
        elif isinstance(d, ToolCallArguments):
            assert d.index in seen
    for call in collect(deltas).tool_calls:
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)


@pytest.mark.parametrize("fmt,text,kw", SAMPLES, ids=SAMPLE_IDS)
def test_every_split_point_matches_parse(fmt, text, kw):
    expected = comparable(ChatOutputParser(fmt, TOOLS, **kw).parse(text))
    for i in range(len(text) + 1):
        deltas, _ = stream(fmt, [text[:i], text[i:]], **kw)
        assert comparable(collect(deltas)) == expected, f"split at {i}: {text[:i]!r} | {text[i:]!r}"


@pytest.mark.parametrize("fmt,text,kw", SAMPLES, ids=SAMPLE_IDS)
def test_char_by_char_and_random_chunks_match_parse(fmt, text, kw):
    parser = ChatOutputParser(fmt, TOOLS, **kw)
    expected = comparable(parser.parse(text))
    chunkings = [list(text)]
    rng = random.Random(len(text))
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, min(60, len(text) - 1))))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in chunkings:
        deltas, streamed = stream(fmt, pieces, **kw)
        assert comparable(collect(deltas)) == expected
        assert streamed.has_tool_calls == parser.has_tool_calls
        check_call_deltas(deltas)


def test_samples_parse_as_intended():
    msg = ChatOutputParser("hermes", TOOLS).parse(HERMES_QWEN3)
    assert msg.content == "I'll check the weather and save the helper.\n"
    assert [c.name for c in msg.tool_calls] == ["get_weather", "write_file", "run_shell"]
    assert json.loads(msg.tool_calls[1].arguments)["content"] == CODE
    assert json.loads(msg.tool_calls[2].arguments)["command"] == "python -c \"print(1<2)\" && echo '</tool_call>'"
    msg = ChatOutputParser("qwen3_coder", TOOLS, starts_in_reasoning=True).parse(CODER_FLASH_NEXT)
    assert msg.reasoning.startswith("Need to write")
    assert msg.content == "Writing the module.\n\nDone — both calls issued."
    assert [json.loads(c.arguments) for c in msg.tool_calls] == [
        {"path": "geo/circle.py", "content": CODE, "overwrite": False},
        {"command": "python -m pytest -q -k 'area'", "timeout_s": 90.5, "env": {"LANG": "C.UTF-8"}}]


def texts(deltas, kind):
    return "".join(d.text for d in deltas if isinstance(d, kind))


def test_text_is_held_back_only_while_it_may_start_a_tag():
    parser = ChatOutputParser("hermes", TOOLS, reasoning=False)
    assert texts(parser.feed("Hello <b>"), ContentDelta) == "Hello <b>"
    assert texts(parser.feed(" x <tool_"), ContentDelta) == " x "
    assert texts(parser.feed("tip>"), ContentDelta) == "<tool_tip>"
    assert texts(parser.feed("<"), ContentDelta) == ""
    assert texts(parser.finish(), ContentDelta) == "<"

    parser = ChatOutputParser("hermes", TOOLS, starts_in_reasoning=True)
    assert texts(parser.feed("a <tool_call> b </th"), ReasoningDelta) == "a <tool_call> b "
    assert texts(parser.feed("ought"), ReasoningDelta) == "</thought"

    parser = ChatOutputParser(None, None)  # no tools: nothing to wait for in content
    parser.feed("<think>r</think>")
    assert texts(parser.feed("<tool_ca"), ContentDelta) == "<tool_ca"


def test_call_is_emitted_when_it_closes():
    parser = ChatOutputParser("qwen3_coder", TOOLS, reasoning=False)
    body = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
    assert parser.feed("Ok.\n" + body) == [ContentDelta("Ok.\n")]
    out = parser.feed("</tool_call>")
    assert [type(d) for d in out] == [ToolCallStart, ToolCallArguments]
    assert (out[0].name, out[1].text) == ("get_weather", '{"city": "Rome"}')
    assert parser.has_tool_calls


LONG_CODE = "".join(f'    s{i} = "</parameter>" if i else \'<tool_call>\'  # 東京 é\n' for i in range(700))
LONG_CALLS = {
    "qwen3_coder": ("<tool_call>\n<function=write_file>\n<parameter=path>\nbig.py\n</parameter>\n"
                    f"<parameter=content>\n{LONG_CODE}\n</parameter>\n</function>\n</tool_call>"),
    "hermes": ("<tool_call>\n" + json.dumps({"name": "write_file", "arguments": {"path": "big.py",
                                                                                "content": LONG_CODE}},
                                            ensure_ascii=False) + "\n</tool_call>"),
}


@pytest.mark.parametrize("fmt", ["qwen3_coder", "hermes"])
def test_held_text_stays_bounded_while_a_long_call_streams(fmt):
    """30K characters of code streamed one character at a time: between feeds the parser looks again only at
    a tag or a name cut by the piece's end, never at the call so far (which it keeps, to make it content if it
    is not a call). It had copied and partly searched the whole call on every delta: quadratic (480K
    characters: 2.9 s, now 0.8 s)."""
    text = ("<think>\n" + "Plan: write it. " * 200 + "</think>\n\n" + "Writing the file — «ok». " * 100
            + LONG_CALLS[fmt] + "\nDone.")
    assert len(LONG_CODE) > 30000
    parser = ChatOutputParser(fmt, TOOLS)
    deltas, most_held = [], 0
    for char in text:
        deltas += parser.feed(char)
        most_held = max(most_held, parser.held_chars)
    deltas += parser.finish()
    assert most_held <= len("<parameter=") + MAX_NAME_LEN + 1
    msg = collect(deltas)
    assert json.loads(msg.tool_calls[0].arguments) == {"path": "big.py", "content": LONG_CODE}
    assert msg.content.endswith("«ok». Done.") and msg.reasoning.startswith("Plan:")


@pytest.mark.parametrize("fmt", ["qwen3_coder", "hermes"])
def test_a_call_rejected_late_is_read_once_however_many_calls_open_inside_it(fmt, monkeypatch):
    """The text of a rejected call had all been scanned again as content, so each `<tool_call>` in its value
    opened a scanner that read to the far end again: quadratic (qwen3_coder, 2,000 of them: 9 s in feed, on the
    server's event loop; now 2 ms): only the text from where the scanner decided is scanned again."""
    scanner = get_tool_parser(fmt)
    scanned = []
    scan = scanner.scan
    monkeypatch.setattr(scanner, "scan",
                        lambda self, more, final, start=0:
                        scanned.append(len(more) - start) or scan(self, more, final, start))
    text = rejected_late(fmt, 300)
    msg = ChatOutputParser(fmt, TOOLS, reasoning=False).parse(text)
    assert (msg.content, msg.tool_calls) == (text, [])
    assert sum(scanned) < 2 * len(text)


# Random generations built from the pieces below (fixed seed): whatever the chunking, streamed equals parsed;
# and when nothing is malformed, parsed is what was built.
PROSE = ["Sure — I'll do that.", "Zürich, 東京 and Montréal: ", "e\u0301 (combining) and 👩‍💻 (ZWJ). ",
         "Use <tool_call> tags like this. ", "a < b and c > d; <b>bold</b> ", "Done ✓\n", "שלום עולם. ",
         "Note: </tool_call> and <function=x> in prose. "]
VALUES = ["geo/圆.py", CODE, 'x = "</parameter>"  # a close tag in code\nprint(x)', "", "  padded  ",
          "End a call with </tool_call> and </function>.", '{"a": 1} stays a string', "line\n\n\tindented\n",
          "<tool_call>\n<function=write_file>\n<parameter=path>\nq.py\n</parameter>\n</function>\n</tool_call>"]
MALFORMED_CALLS = [
    "<tool_call>\n<function=delete_all>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</parameter>\n"
    "</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\ncity=Oslo\n</function>\n</tool_call>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}\n</tool_call>',
    "<tool_call>\n<function=run_shell>\n<parameter=command>\nls\n</parameter>\n<parameter=cwd>\n/tmp\n</parameter>\n"
    "</function>\n</tool_call>",
]


def built_call(rng, fmt):
    name, args = rng.choice([
        ("write_file", {"path": rng.choice(VALUES), "content": rng.choice(VALUES)}),
        ("write_file", {"content": rng.choice(VALUES), "overwrite": rng.choice([True, False])}),
        ("get_weather", {"city": rng.choice(VALUES), "days": rng.randint(-3, 30)}),
        ("run_shell", {"command": rng.choice(VALUES), "timeout_s": rng.choice([0.5, 90.25, 3])}),
    ])
    if fmt == "hermes":
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>", (name, args)
    params = "".join(f"<parameter={k}>\n{json.dumps(v) if not isinstance(v, str) else v}\n</parameter>\n"
                     for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>", (name, args)


def built_generation(rng, fmt, malformed):
    """A generation and the message it stands for (content, reasoning, calls; not meant to hold when a
    malformed call went in)."""
    text, content, calls = [], [], []
    reasoning = None
    if rng.random() < 0.5:
        reasoning = "".join(rng.choices(PROSE, k=rng.randint(1, 3)))
        text.append(f"<think>\n{reasoning}</think>\n\n")
    for _ in range(rng.randint(0, 4)):
        prose = "".join(rng.choices(PROSE, k=rng.randint(0, 2)))
        text.append(prose)
        content.append(prose)
        if rng.random() < 0.2 and malformed:
            text.append(rng.choice(MALFORMED_CALLS))
        else:
            call_text, call = built_call(rng, fmt)
            text.append(call_text)
            calls.append(call)
        text.append(rng.choice(["", "\n", "\n\n"]))
    tail = "".join(rng.choices(PROSE, k=rng.randint(0, 2)))
    text.append(tail)
    content.append(tail)
    return "".join(text), ("".join(content) or None, reasoning, calls)


def random_chunkings(rng, text, n):
    yield list(text)
    for _ in range(n if len(text) > 1 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, min(50, len(text) - 1))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("fmt", ["qwen3_coder", "hermes"])
def test_random_generations_stream_as_they_parse(fmt):
    rng = random.Random(20240611)
    for case in range(150):
        text, built = built_generation(rng, fmt, malformed=case % 3 == 0)
        cut = case % 5 == 4  # cut short at max_tokens, a call left open as often as not
        if cut:
            text = text[:rng.randint(0, len(text))]
        parser = ChatOutputParser(fmt, TOOLS)
        parsed = parser.parse(text, truncated=cut)
        if case % 3 and not cut:
            assert (parsed.content, parsed.reasoning, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]) \
                == built, text
        for pieces in random_chunkings(rng, text, 4):
            deltas, streamed = stream(fmt, pieces, truncated=cut)
            assert comparable(collect(deltas)) == comparable(parsed), (text, pieces)
            assert streamed.has_tool_calls == parser.has_tool_calls
            check_call_deltas(deltas)


def test_a_forced_call_starts_streaming_once_its_name_is_read():
    """stream_call_start (tool_choice required or named: the grammar makes every call well formed): the call's
    start goes out with the piece that completes `<function=NAME>`, its arguments at `</tool_call>`."""
    parser = ChatOutputParser("qwen3_coder", TOOLS, reasoning=False, stream_call_start=True)
    assert parser.feed("Ok.\n<tool_call>\n<function=get_wea") == [ContentDelta("Ok.\n")]
    out = parser.feed("ther>\n<parameter=city>\nRo")
    assert [type(d) for d in out] == [ToolCallStart] and out[0].name == "get_weather" and parser.has_tool_calls
    assert parser.feed("me\n</parameter>\n</function>\n") == []
    assert parser.feed("</tool_call>") == [ToolCallArguments(out[0].index, '{"city": "Rome"}')]
    # without it the call waits for its end (test_call_is_emitted_when_it_closes). A hermes object that opens with
    # its name starts once that string closes; one that names itself last, at its end
    hermes = ChatOutputParser("hermes", TOOLS, reasoning=False, stream_call_start=True)
    assert hermes.feed('<tool_call>\n{"name": "get_wea') == []
    out = hermes.feed('ther", "arguments": {"city": "Ro')
    assert [(type(d), d.name) for d in out] == [(ToolCallStart, "get_weather")]
    assert hermes.feed('me"}}\n</tool_call>') == [ToolCallArguments(out[0].index, '{"city": "Rome"}')]
    hermes = ChatOutputParser("hermes", TOOLS, reasoning=False, stream_call_start=True)
    assert hermes.feed('<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"') == []
    assert [type(d) for d in hermes.feed("}\n</tool_call>")] == [ToolCallStart, ToolCallArguments]
    # a name that is not one of the tools starts nothing (the call is content at its end)
    hermes = ChatOutputParser("hermes", TOOLS, reasoning=False, stream_call_start=True)
    assert hermes.feed('<tool_call>\n{"name": "rm_rf", "arguments": {') == []


@pytest.mark.parametrize("fmt,text,kw", [("qwen3_coder", CODER_FLASH_NEXT, {"starts_in_reasoning": True}),
                                         ("hermes", HERMES_QWEN3, {})], ids=["qwen3_coder", "hermes"])
def test_streamed_starts_of_well_formed_calls_add_up_to_the_parse(fmt, text, kw):
    expected = comparable(ChatOutputParser(fmt, TOOLS, **kw).parse(text))
    rng = random.Random(7)
    chunkings = [list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, 60)))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in reversed(chunkings):   # char by char last: `fed` below is its
        parser = ChatOutputParser(fmt, TOOLS, stream_call_start=True, **kw)
        fed = [(i, d) for i, piece in enumerate(pieces) for d in parser.feed(piece)]
        deltas = [d for _, d in fed] + parser.finish()
        assert comparable(collect(deltas)) == expected
        check_call_deltas(deltas)
    # char by char, each call's start came many pieces before its arguments
    starts = {d.index: i for i, d in fed if isinstance(d, ToolCallStart)}
    arguments = {d.index: i for i, d in fed if isinstance(d, ToolCallArguments)}
    assert len(starts) == len(expected[2]) >= 2 and all(starts[k] < arguments[k] - 20 for k in starts)


def test_a_started_call_that_does_not_end_well_keeps_its_start_and_its_text_is_content():
    cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRo"   # max_tokens inside the value
    for pieces in ([cut], list(cut)):
        deltas, _ = stream("qwen3_coder", pieces, truncated=True, reasoning=False, stream_call_start=True)
        msg = collect(deltas)
        assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", "")] and msg.content == cut
    # rejected after its start (what the grammar does not let a model write): the start stays, the text is content
    # — where the stream and the parse of the whole text differ (the parse never saw the call open)
    junk = "<tool_call>\n<function=get_weather>\nxyz"
    deltas, _ = stream("qwen3_coder", list(junk), reasoning=False, stream_call_start=True)
    msg = collect(deltas)
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", "")] and msg.content == junk
    whole = ChatOutputParser("qwen3_coder", TOOLS, reasoning=False, stream_call_start=True).parse(junk)
    assert whole.tool_calls == [] and whole.content == junk
    # an object that names another function after the first (JSON keeps the last) is not the call it started
    twice = '<tool_call>\n{"name": "get_weather", "arguments": {}, "name": "run_shell"}\n</tool_call>'
    deltas, _ = stream("hermes", list(twice), reasoning=False, stream_call_start=True)
    msg = collect(deltas)
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", "")] and msg.content == twice
