"""Streaming: whatever the chunking, the deltas add up to the non-streamed parse, and text is emitted as
soon as it cannot be the start of a tag."""
import json
import random
import re

import pytest

from flashnext.server.parsers import (ChatOutputParser, ContentDelta, ReasoningDelta, ToolCallArguments,
                                      ToolCallStart, collect)

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
]
SAMPLE_IDS = ["hermes-qwen3", "coder-flash-next", "no-tools-used", "hermes-thinking-off", "hermes-truncated",
              "hermes-python-dict", "hermes-nested-tags", "hermes-unknown-name", "coder-truncated-value",
              "coder-unknown-then-forgiven", "coder-broken-name"]
ID = re.compile(r"^call_[A-Za-z0-9]{24}$")


def stream(fmt, pieces, **kw):
    parser = ChatOutputParser(fmt, TOOLS, **kw)
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
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


def test_long_call_streamed_finely_stays_linear():
    big = "x = 1\n" * 20000
    text = (f"<tool_call>\n<function=write_file>\n<parameter=content>\n{big}\n</parameter>\n</function>\n"
            "</tool_call>")
    hermes = "<tool_call>" + json.dumps({"name": "write_file", "arguments": {"content": big}}) + "</tool_call>"
    for fmt, t in (("qwen3_coder", text), ("hermes", hermes)):
        deltas, _ = stream(fmt, [t[i:i + 3] for i in range(0, len(t), 3)], reasoning=False)
        assert json.loads(collect(deltas).tool_calls[0].arguments)["content"] == big
