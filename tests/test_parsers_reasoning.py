"""Reasoning: `<think>…</think>`, templates that open `<think>` in the prompt, thinking disabled."""
import json

import pytest

from flashnext.server.parsers import ChatOutputParser

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}}}}}]

HERMES_CALL = ('<tool_call>\n{"name": "search", "arguments": {"query": "H₂O boiling point", "top_k": 3}}\n'
               '</tool_call>')
CODER_CALL = ("<tool_call>\n<function=search>\n<parameter=query>\nH₂O boiling point\n</parameter>\n"
              "<parameter=top_k>\n3\n</parameter>\n</function>\n</tool_call>")
ARGS = {"query": "H₂O boiling point", "top_k": 3}


def parse(text, fmt="hermes", **kw):
    parser = ChatOutputParser(fmt, TOOLS, **kw)
    return parser.parse(text), parser


@pytest.mark.parametrize("fmt,call", [("hermes", HERMES_CALL), ("qwen3_coder", CODER_CALL)])
def test_think_then_content_then_call(fmt, call):
    text = f"<think>\nThe user asks about water. I'll search.\n</think>\n\nSearching now.\n{call}"
    msg, parser = parse(text, fmt)
    assert msg.reasoning == "The user asks about water. I'll search.\n"
    assert msg.content == "Searching now.\n"
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [("search", ARGS)]
    assert parser.has_tool_calls


@pytest.mark.parametrize("fmt,call", [("hermes", HERMES_CALL), ("qwen3_coder", CODER_CALL)])
def test_starts_in_reasoning(fmt, call):
    # The template wrote `<think>\n` into the prompt: the generation only shows the close tag.
    text = f"Water boils at 100 °C at sea level; let me verify.\n</think>\n\n{call}"
    msg, _ = parse(text, fmt, starts_in_reasoning=True)
    assert msg.reasoning == "Water boils at 100 °C at sea level; let me verify.\n"
    assert msg.content is None
    assert len(msg.tool_calls) == 1
    # Some models still repeat the open tag: it is not part of the reasoning.
    msg2, _ = parse("<think>\n" + text, fmt, starts_in_reasoning=True)
    assert (msg2.reasoning, msg2.content) == (msg.reasoning, msg.content)


def test_without_the_flag_a_bare_close_tag_is_content():
    msg, _ = parse("thinking...</think>answer")
    assert msg.reasoning is None and msg.content == "thinking...</think>answer"


def test_truncated_reasoning_stays_reasoning():
    msg, parser = parse("<think>\nStep 1: consider <tool_call> formats.\nStep 2: ")
    assert msg.reasoning == "Step 1: consider <tool_call> formats.\nStep 2: " and msg.content is None
    msg, _ = parse("Still thinking </thi", starts_in_reasoning=True)
    assert msg.reasoning == "Still thinking </thi"


@pytest.mark.parametrize("fmt,call", [("hermes", HERMES_CALL), ("qwen3_coder", CODER_CALL)])
def test_tool_call_inside_reasoning_is_reasoning(fmt, call):
    text = f"<think>\nI could emit {call} but first I check the docs.\n</think>\n\nNo call needed."
    msg, parser = parse(text, fmt)
    assert msg.reasoning == f"I could emit {call} but first I check the docs.\n"
    assert msg.content == "No call needed." and msg.tool_calls == [] and not parser.has_tool_calls


def test_thinking_disabled_parses_no_reasoning():
    text = "<think>\nnot reasoning\n</think>\n\nHello"
    msg, _ = parse(text, reasoning=False)
    assert msg.reasoning is None and msg.content == text
    msg, _ = parse("\n\nHello", reasoning=False)
    assert msg.content == "\n\nHello"  # nothing is framing when thinking is off
    msg, parser = parse("Sure.\n" + HERMES_CALL, reasoning=False)
    assert msg.content == "Sure.\n" and parser.has_tool_calls


def test_empty_think_block_and_no_think_block():
    # Qwen3 with /no_think writes an empty block.
    msg, _ = parse("<think>\n\n</think>\n\nHi there.")
    assert msg.reasoning is None and msg.content == "Hi there."
    msg, _ = parse("\nHi <thinking> people.")
    assert msg.reasoning is None and msg.content == "Hi <thinking> people."
    msg, _ = parse("<thin")
    assert msg.content == "<thin"
    msg, _ = parse("")
    assert (msg.content, msg.reasoning, msg.tool_calls) == (None, None, [])


def test_second_think_block_is_content():
    msg, _ = parse("<think>a</think>b<think>c</think>")
    assert (msg.reasoning, msg.content) == ("a", "b<think>c</think>")
