"""What the chat output parser produces: streamed deltas, and the whole message they add up to."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """The first fragment of a call: the only one that carries its id, type and name."""
    index: int
    id: str
    name: str
    type: str = "function"


@dataclass(frozen=True)
class ToolCallArguments:
    """A piece of a call's arguments; a call's pieces concatenate to the JSON text of its arguments."""
    index: int
    text: str


Delta = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArguments


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text, from json_body.json_text
    type: str = "function"


@dataclass
class ParsedMessage:
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def collect(deltas: list[Delta]) -> ParsedMessage:
    """The message a client sees once it has concatenated every delta of a stream."""
    content: list[str] = []
    reasoning: list[str] = []
    starts: dict[int, ToolCallStart] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
        elif isinstance(delta, ReasoningDelta):
            reasoning.append(delta.text)
        elif isinstance(delta, ToolCallStart):
            assert delta.index not in starts, f"call {delta.index} started twice"
            starts[delta.index] = delta
            arguments[delta.index] = []
        else:
            assert delta.index in starts, f"arguments of call {delta.index} before its start"
            arguments[delta.index].append(delta.text)
    calls = [ToolCall(id=starts[i].id, name=starts[i].name, arguments="".join(arguments[i]))
             for i in sorted(starts)]
    return ParsedMessage(content="".join(content) or None, reasoning="".join(reasoning) or None,
                         tool_calls=calls)
