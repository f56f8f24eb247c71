"""qwen3_coder values that hold the format's own tags (code, templates, parser fixtures), and calls that
slip (a `</parameter>` left out, a key the tool lacks): where each value ends (the well-formed cases are those
of vLLM's tests/tool_parsers/test_qwen3_xml_coder_shared.py, read as vLLM's qwen3_coder parser reads them),
and the same result however the text is streamed."""
import json
import random

import pytest

from flashnext.server.parsers import ChatOutputParser, collect
from flashnext.server.parsers.qwen3_coder import Qwen3CoderCallScanner


def tool(name, **types):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in types.items()}}}}


TOOLS = [tool("write_file", path="string", content="string"), tool("foo", bar="string"),
         tool("get_weather", city="string", state="string", unit="string"),
         tool("edit", path="string", old="string", new="string", count="integer")]


def call(name, *params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# vLLM's fixtures: a value that is itself Python holding the tags
CODE_WITH_TAGS = ('char_deltas = [\n    "<tool_call>\\n",\n    "<parameter=query>\\n",\n    "\\n</parameter>\\n",\n'
                  '    "</function>\\n",\n]')
PARAM_LIKE_LINES = ('TOOL_CALL_TEMPLATE = """\n</parameter>\n<parameter=new_string>\n#!/usr/bin/env python3\n'
                    '</parameter>\n"""')
REAL_NAME_LITERAL = 'doc = """\n<parameter=path>\nliteral/value\n</parameter>\n"""'
NESTED_CALL = 'doc = """\n' + call("write_file", ("path", "literal/value.txt"), ("content", "hello")) + '\n"""'
NESTED_FOO = ('template = """\n<tool_call>\n<function=foo>\n<parameter=bar>baz</parameter>\n</function>\n'
              '</tool_call>\n"""')


def cut_after_quoted_call(text):
    return text[:text.index('</tool_call>\n"""') + len("</tool_call>")]


WHOLE = call("write_file", ("path", "f.py"), ("content", NESTED_CALL))
TRUNCATED = WHOLE[:WHOLE.rindex('</tool_call>\n"""')]  # the quoted call's </function> is the text's last tag
ENDED_AFTER_QUOTED_CALL = cut_after_quoted_call(WHOLE)
DOC = "Usage:\n<parameter=path>\nthe file to write\n</parameter>\nend of docs"
# rejected only after its value (junk where `</tool_call>` belongs), that value quoting a call; then a call
REJECTED_AROUND_A_CALL = ("<tool_call>\n<function=write_file>\n<parameter=content>\n" + call("foo", ("bar", "x"))
                          + "\n</parameter>\n</function>\njunk\n")
# its value slipped (no `</parameter>`), and the second reading is rejected at the junk after it; then a call
SLIPPED_THEN_REJECTED = ("<tool_call>\n<function=write_file>\n<parameter=content>\nx <tool_call>\n"
                         "<parameter=path>\np\n</parameter>\n</function>\njunk\n")
# an unfinished call that holds whole calls (a value quoting them, or a call abandoned for another)
UNFINISHED_AROUND_CALLS = ("<tool_call>\n<function=foo>\n<parameter=bar>\nx\n</function>\n</tool_call>\n"
                           + call("foo", ("bar", "y")) + "\n" + call("foo", ("bar", "z")))

CASES = [
    # (id, text, content, calls)
    ("close-tag-inside-code", call("write_file", ("path", "test.py"), ("content", CODE_WITH_TAGS)),
     None, [("write_file", {"path": "test.py", "content": CODE_WITH_TAGS})]),
    ("param-like-lines-undeclared-key", call("write_file", ("path", "t.py"), ("content", PARAM_LIKE_LINES)),
     None, [("write_file", {"path": "t.py", "content": PARAM_LIKE_LINES})]),
    ("nested-pair-of-a-declared-key", call("write_file", ("path", "fixture.py"), ("content", REAL_NAME_LITERAL)),
     None, [("write_file", {"path": "fixture.py", "content": REAL_NAME_LITERAL})]),
    ("whole-call-quoted", call("write_file", ("path", "fixture.py"), ("content", NESTED_CALL)),
     None, [("write_file", {"path": "fixture.py", "content": NESTED_CALL})]),
    ("whole-call-quoted-before-path", call("write_file", ("content", NESTED_CALL), ("path", "fixture.py")),
     None, [("write_file", {"content": NESTED_CALL, "path": "fixture.py"})]),
    ("second-call-quotes-the-first", call("foo", ("bar", "baz")) + "\n\n"
     + call("write_file", ("path", "fixture.py"), ("content", NESTED_FOO)),
     None, [("foo", {"bar": "baz"}), ("write_file", {"path": "fixture.py", "content": NESTED_FOO})]),
    ("close-then-whitespace-then-text", call("edit", ("path", "a.py"), ("old", "x = 1\n</parameter>\n  y = 2")),
     None, [("edit", {"path": "a.py", "old": "x = 1\n</parameter>\n  y = 2"})]),
    # slips, read a second time once the generation ends
    ("missing-close", "Let me check:\n<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n"
     "<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>",
     "Let me check:\n", [("get_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})]),
    ("undeclared-keys", call("get_weather", ("city", "Oslo"), ("lat", "59.9"), ("unit", "celsius"), ("hint", "fjord"))
     + "\nDone.", "Done.", [("get_weather", {"city": "Oslo", "lat": "59.9", "unit": "celsius", "hint": "fjord"})]),
    ("undeclared-key-then-another-call", call("edit", ("path", "a"), ("line", "3"), ("count", "2")) + "\n"
     + call("foo", ("bar", "1")), None,
     [("edit", {"path": "a", "line": "3", "count": 2}), ("foo", {"bar": "1"})]),
    ("slipped-then-rejected-then-a-call", SLIPPED_THEN_REJECTED + call("write_file", ("path", "q")),
     SLIPPED_THEN_REJECTED, [("write_file", {"path": "q"})]),
    # the second reading starts at the value left open: the values before it stay as the first reading closed them
    ("slip-after-a-value-quoting-a-pair", call("write_file", ("content", DOC), ("path", "docs.md"),
                                                ("encoding", "utf-8")),
     None, [("write_file", {"content": DOC, "path": "docs.md", "encoding": "utf-8"})]),
    ("slip-after-a-value-quoting-a-call", call("write_file", ("content", NESTED_CALL), ("path", "f.py"),
                                                ("encoding", "utf-8")),
     None, [("write_file", {"content": NESTED_CALL, "path": "f.py", "encoding": "utf-8"})]),
    # a rejected call is content, and so are the calls quoted in its values: only a call after the point where
    # the reading failed opens
    ("rejected-late-around-a-call", REJECTED_AROUND_A_CALL + call("foo", ("bar", "y")),
     REJECTED_AROUND_A_CALL, [("foo", {"bar": "y"})]),
    # the generation ended inside a call: content, even where the value's tags would close a call at the end,
    # and no call opens inside it
    ("truncated-in-quoted-call", TRUNCATED, TRUNCATED, []),
    ("truncated-after-close", "<tool_call>\n<function=foo>\n<parameter=bar>\nx\n</parameter>\n",
     "<tool_call>\n<function=foo>\n<parameter=bar>\nx\n</parameter>\n", []),
    ("truncated-in-key-after-close", "<tool_call>\n<function=foo>\n<parameter=bar>\nx\n</parameter>\n<parameter=ba",
     "<tool_call>\n<function=foo>\n<parameter=bar>\nx\n</parameter>\n<parameter=ba", []),
    ("ended-after-a-quoted-call", ENDED_AFTER_QUOTED_CALL, ENDED_AFTER_QUOTED_CALL, []),
    ("unfinished-around-calls", UNFINISHED_AROUND_CALLS, UNFINISHED_AROUND_CALLS, []),
]

CUT_IN_PATH_FIRST = cut_after_quoted_call(call("write_file", ("path", "real.py"), ("content", NESTED_CALL)))
CUT_IN_CONTENT_FIRST = cut_after_quoted_call(call("write_file", ("content", NESTED_CALL), ("path", "real.py")))
CUT_AFTER_SLIP = call("get_weather", ("city", "Oslo"), ("lat", "59.9")) + "\nDone"

# cut at max_tokens (finish_reason "length"): a call left open is content, never read a second time
CUT_CASES = [
    ("cut-after-a-quoted-call", CUT_IN_PATH_FIRST, CUT_IN_PATH_FIRST, []),
    ("cut-after-a-quoted-call-before-path", CUT_IN_CONTENT_FIRST, CUT_IN_CONTENT_FIRST, []),
    ("cut-after-a-slipped-call", CUT_AFTER_SLIP, CUT_AFTER_SLIP, []),
    ("cut-after-a-whole-call", call("foo", ("bar", "1")) + "\nDone", "Done", [("foo", {"bar": "1"})]),
]
ALL_CASES = [(*c, False) for c in CASES] + [(*c, True) for c in CUT_CASES]


def comparable(msg):
    return msg.content, msg.reasoning, [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]


@pytest.mark.parametrize("text,content,calls,cut", [c[1:] for c in ALL_CASES], ids=[c[0] for c in ALL_CASES])
def test_where_a_value_ends(text, content, calls, cut):
    parser = ChatOutputParser("qwen3_coder", TOOLS, reasoning=False)
    assert comparable(parser.parse(text, truncated=cut)) == (content, None, calls)


@pytest.mark.parametrize("text,cut", [(c[1], c[4]) for c in ALL_CASES], ids=[c[0] for c in ALL_CASES])
def test_streamed_the_same_at_every_split_and_char_by_char(text, cut):
    expected = comparable(ChatOutputParser("qwen3_coder", TOOLS, reasoning=False).parse(text, truncated=cut))
    rng = random.Random(7)
    chunkings = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, 40)))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in chunkings:
        parser = ChatOutputParser("qwen3_coder", TOOLS, reasoning=False)
        deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish(truncated=cut)
        assert comparable(collect(deltas)) == expected, pieces


def test_only_a_slipped_call_waits_for_the_end():
    """A well-formed call is out at its `</tool_call>`; one that needs the second reading cannot be until the
    generation ends (another `</parameter>` might still close its value)."""
    parser = ChatOutputParser("qwen3_coder", TOOLS, reasoning=False)
    assert len(parser.feed(call("write_file", ("path", "p"), ("content", NESTED_CALL)))) == 2
    slipped = call("get_weather", ("city", "Oslo"), ("lat", "59.9"))
    parser = ChatOutputParser("qwen3_coder", TOOLS, reasoning=False)
    assert parser.feed(slipped + "\nmore") == []
    assert comparable(collect(parser.finish())) == ("more", None, [("get_weather", {"city": "Oslo", "lat": "59.9"})])


def test_an_unfinished_call_is_read_once_however_many_calls_open_inside_it(monkeypatch):
    """Each `<tool_call>` inside an unfinished call had opened a scanner that read to the end twice: quadratic
    (4,000 of them: 12.8 s, on the server's event loop). Now the call is content, and its text is scanned at
    most twice (the second reading from the value left open)."""
    scanned = []
    scan = Qwen3CoderCallScanner.scan
    monkeypatch.setattr(Qwen3CoderCallScanner, "scan",
                        lambda self, more, final, start=0:
                        scanned.append(len(more) - start) or scan(self, more, final, start))
    opening = "<tool_call>\n<function=write_file>\n<parameter=content>\n"
    text = opening + ("x " + opening) * 300
    msg = ChatOutputParser("qwen3_coder", TOOLS, reasoning=False).parse(text)
    assert (msg.content, msg.tool_calls) == (text, [])
    assert sum(scanned) < 2 * len(text)
