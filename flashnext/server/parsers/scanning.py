"""The contract between the chat output state machine and a tool-call format.

After `<tool_call>` the state machine hands the text that follows it to a fresh scanner of the request's
format, again each time more text arrives (the text only grows). The scanner answers:
- None: undecided, send more text;
- REJECTED: this is not a well-formed call of a requested tool; `<tool_call>` is content after all, and
  everything after it is scanned again as content;
- ScannedCall: a complete call; `end` is where it stops, just past `</tool_call>`.
A verdict may depend only on the text given, never on how it was cut into pieces: that is what keeps
streamed and non-streamed results identical. With final=True (the generation ended) it must not answer
None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from flashnext.server.parsers.tool_schema import ToolSchemas


@dataclass(frozen=True)
class ScannedCall:
    name: str
    arguments: dict[str, Any]
    end: int


class _Rejected:
    def __repr__(self) -> str:
        return "REJECTED"


REJECTED = _Rejected()

ScanVerdict = ScannedCall | _Rejected | None


class ToolCallScanner(Protocol):
    def __init__(self, tools: ToolSchemas): ...

    def scan(self, text: str, final: bool) -> ScanVerdict: ...
