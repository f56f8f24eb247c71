"""The contract between the chat output state machine and a tool-call format.

After `<tool_call>` the state machine makes a fresh scanner of the request's format and hands it the text that
follows, piece by piece as it arrives. After each piece the scanner answers:
- None: undecided, send more text;
- Rejected: this is not a well-formed call of a requested tool; `<tool_call>` is content after all. `end` is
  how far the reading that decided went, in the pieces joined (where the element it could not read starts, or
  where a JSON object that is not a call ends): the text before it is content in which no call opens (a
  `<tool_call>` there is inside one of the call's values), and the text from `end` on is scanned again as
  content. Scanning again from the call's start was quadratic for a call rejected late: each `<tool_call>`
  quoted in its values opened a scanner that read to the same far end;
- ScannedCall: a complete call; `end` is where it stops in the pieces joined, just past `</tool_call>`;
- UNFINISHED (only with final=True): the generation ended inside the call. It is content, `<tool_call>` and
  all, and no call opens inside it: a call within an unfinished one is more often quoted in a value than real,
  and scanning again from each of them, to the end every time, is quadratic in their number.
A verdict may depend only on the text given, never on how it was cut into pieces: that is what keeps
streamed and non-streamed results identical. With final=True (the generation ended) it must not answer
None.

Between pieces a scanner re-examines only `held_chars` (a tag or name cut by a piece's end), never the call so
far, so a long call streamed a character at a time costs linear time. It may keep the call's text, to read it
again at the end.

A call's first piece comes with `start`, where the call begins in it: at the end of a generation each call it
still holds is handed all the rest of it, and copying that for every such call was quadratic. The scanners of one
generation share `shared`, a dict where one may keep what it learned about the finished text for the next.
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


@dataclass(frozen=True)
class Rejected:
    end: int


class _Verdict:
    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return self._name


UNFINISHED = _Verdict("UNFINISHED")

ScanVerdict = ScannedCall | Rejected | _Verdict | None


class ToolCallScanner(Protocol):
    def __init__(self, tools: ToolSchemas, shared: dict): ...

    def scan(self, more: str, final: bool, start: int = 0) -> ScanVerdict: ...

    @property
    def held_chars(self) -> int: ...

    @property
    def name(self) -> str | None:
        """The function the call names once read (one of the request's tools), before the verdict; None until then
        (or for a format that reads it only with the whole call): what chat_output's stream_call_start sends."""
        ...
