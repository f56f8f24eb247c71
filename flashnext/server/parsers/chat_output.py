"""One state machine from generated text to reasoning, content and tool calls, streamed or not.

Decisions:
- Calls are held until `</tool_call>` and emitted whole (start, then the arguments in one fragment). A
  call streamed early could not be taken back when it turns out malformed or truncated, and an agent
  acting on half a call is worse than one waiting for it. Except under a forced tool choice
  (`stream_call_start`: tool_choice "required" or a named function), whose grammar lets the model write only
  well-formed calls of the request's tools: there a call's start (id and name) goes out as soon as the scanner
  has read the name, the arguments at `</tool_call>` — so a client sees the call begin within a few tokens, not
  when its last argument is written (an agent's turn used to show nothing for the whole call: 1.6 s of the H200's
  agentic turn 12, session 22). A started call that does not end well — cut at max_tokens, or (a grammar letting
  through what the parser refuses) rejected, or a JSON object that names a second function after the first —
  keeps its start with no arguments, and its text follows as content.
  The rejected and the renamed ones are where a stream can add up to something else than the message `parse`
  makes of the same text: the parse, handed the whole call at once, decides it before it could start.
- A call naming a function that is not among the request's tools is content, not a call: the client
  cannot dispatch it, and it is most often the model quoting or inventing a call in prose. Shown as
  text, nothing is lost; as a call, the agent would fail on it. A call with a missing or ill-typed
  parameter is still a call: the tool reports that to the agent, which can retry.
- A call that is not well formed is content up to where its reading failed, calls quoted in its values
  included; only the text from there on is looked at for calls again (scanning.py says why).
- Whitespace that opens a section (before `<think>`, after `<think>`, `</think>` and `</tool_call>`) is
  framing written by the template, not text, and is dropped. Nothing else is dropped.
- Text is held back only while it may be the start of the next tag: `<think>` at the start, `</think>`
  in reasoning, `<tool_call>` in content (only when the request has tools).
- A call the generation ended inside is content, and so are the calls it holds. Cut at max_tokens, it is not
  read a second time either (a slipped call's second reading, qwen3_coder.py): the text stopped at a limit, not
  where the model meant it to, and a value quoting a call can look like a call that ends there.
"""
from __future__ import annotations

import secrets
import string
from enum import Enum
from typing import Any

from flashnext.server.json_body import json_text
from flashnext.server.parsers.messages import (ContentDelta, Delta, ParsedMessage, ReasoningDelta,
                                                ToolCallArguments, ToolCallStart, collect)
from flashnext.server.parsers.registry import get_tool_parser
from flashnext.server.parsers.scanning import UNFINISHED, Rejected, ScannedCall, ToolCallScanner
from flashnext.server.parsers.tags import THINK_CLOSE, THINK_OPEN, TOOL_CALL_OPEN, partial_tag_len, skip_whitespace
from flashnext.server.parsers.tool_schema import ToolSchemas

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class _Section(Enum):
    START = "start"          # before the first text: a `<think>` may open
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL_CALL = "tool_call"  # after `<tool_call>`, until the scanner decides


class ChatOutputParser:
    """Feed the generated text as it is decoded; get back deltas. `parse` does the same for a whole text.

    tool_format: "hermes", "qwen3_coder", or None when the request has no tools.
    tools: the request's `tools` (dicts or pydantic models); a call must name one of them.
    reasoning: whether thinking is enabled; if not, `<think>` is ordinary content.
    starts_in_reasoning: the prompt already opened `<think>`, so the generation begins inside reasoning
      and only its `</think>` shows; without it, a generation that does not begin with `<think>` has no
      reasoning at all.
    stream_call_start: a call's start goes out once its name is read (the forced tool choices: see Decisions).
    """

    def __init__(self, tool_format: str | None, tools: Any = None, reasoning: bool = True,
                 starts_in_reasoning: bool = False, stream_call_start: bool = False):
        self._tools = ToolSchemas(tools)
        scanner_type = get_tool_parser(tool_format) if tool_format is not None else None
        self._scanner_type: type[ToolCallScanner] | None = scanner_type if self._tools else None
        self._starts_in_reasoning = starts_in_reasoning
        self._section = _Section.START if reasoning else _Section.CONTENT
        self._skip_whitespace = reasoning
        # Text outside a call not yet emitted, from _pending_at: between feeds at most a possible tag prefix; after
        # a call, the rest of its text (at finish, of the generation: not sliced off again for every call in it).
        self._pending = ""
        self._pending_at = 0
        self._scanner: ToolCallScanner | None = None
        self._shared_by_scanners: dict = {}  # what the scanners keep for the next (scanning.py)
        self._call_text: list[str] = []  # the open call's text, as it came: content if it is not a call
        self._call_start = 0  # where the call starts in _call_text[0]
        self._call_ids: set[str] = set()
        self._stream_call_start = stream_call_start
        self._started: tuple[int, str] | None = None  # the open call's (index, name) once its start went out
        self._out: list[Delta] = []
        self._text: list[str] = []  # reasoning or content (by _section) not yet in _out
        self._used = False
        self._finished = False

    @property
    def has_tool_calls(self) -> bool:
        """Whether a call was emitted: the choice's finish_reason is then `tool_calls`."""
        return bool(self._call_ids)

    @property
    def held_chars(self) -> int:
        """Characters the next feed looks at again: a tag, or a name, cut by a piece's end. It never grows
        with the length of a call or of the text, which is what keeps streaming linear (the open call's text
        is kept as well, but read again only when the call ends: as content, or by a second reading)."""
        return len(self._pending) - self._pending_at + (self._scanner.held_chars if self._scanner is not None else 0)

    def feed(self, delta_text: str) -> list[Delta]:
        """A rejected call hands back the text after it to be scanned again, by offset: a scanner takes its first
        piece without copying it (960K characters of "<tool_call>\n" in one feed had taken 3 s, on the server's event
        loop, when each rejection copied the rest)."""
        assert not self._finished, "feed after finish"
        self._used = True
        self._advance(delta_text, final=False)
        return self._take()

    def finish(self, truncated: bool = False) -> list[Delta]:
        """The generation ended (truncated: at max_tokens): release what was held back; an unfinished call
        becomes content."""
        assert not self._finished, "finish called twice"
        self._used = self._finished = True
        if truncated and self._section is _Section.TOOL_CALL:
            self._end_unfinished_call()
        self._advance("", final=True)
        assert self._pending_at == len(self._pending) and self._scanner is None, "text left behind at finish"
        return self._take()

    def parse(self, full_text: str, truncated: bool = False) -> ParsedMessage:
        """The non-streaming result: exactly what the concatenated deltas of any chunking add up to."""
        assert not self._used, "parse needs a fresh parser"
        return collect(self.feed(full_text) + self.finish(truncated))

    def _take(self) -> list[Delta]:
        self._flush_text()
        out, self._out = self._out, []
        return out

    def _emit_text(self, text: str) -> None:
        if text:
            self._text.append(text)

    def _flush_text(self) -> None:
        """One delta for the text since the last call or section change, however many pieces it came in."""
        if self._text:
            kind = ReasoningDelta if self._section is _Section.REASONING else ContentDelta
            self._out.append(kind("".join(self._text)))
            self._text = []

    def _start_call(self, name: str) -> int:
        """The call's start (a fresh id) → its index."""
        self._flush_text()
        call_id = new_call_id()
        while call_id in self._call_ids:
            call_id = new_call_id()
        index = len(self._call_ids)
        self._call_ids.add(call_id)
        self._out.append(ToolCallStart(index=index, id=call_id, name=name))
        return index

    def _emit_call(self, call: ScannedCall) -> None:
        index = self._started[0] if self._started is not None else self._start_call(call.name)
        # json.dumps's default separators, as vLLM's parsers write arguments ({"city": "Paris"}).
        self._out.append(ToolCallArguments(index=index, text=json_text(call.arguments, separators=(", ", ": "))))

    def _advance(self, text: str, final: bool) -> None:
        start = 0  # where the call that opened in text starts
        while True:
            if self._section is _Section.TOOL_CALL:
                if not self._call_text:
                    self._call_text, self._call_start = [text], start
                elif text:
                    self._call_text.append(text)
                verdict = self._scanner.scan(text, final, start)
                if verdict is None:
                    if self._stream_call_start and self._started is None and self._scanner.name is not None:
                        self._started = self._start_call(self._scanner.name), self._scanner.name
                    return
                if verdict is UNFINISHED:
                    self._end_unfinished_call()
                    return
                body, at = self._call_body()
                self._scanner, self._call_text, self._section = None, [], _Section.CONTENT
                # a started call must end as the call it started (a JSON object naming two functions would not)
                if isinstance(verdict, Rejected) or (self._started is not None and verdict.name != self._started[1]):
                    self._emit_text(TOOL_CALL_OPEN + body[at:at + verdict.end])
                else:
                    self._emit_call(verdict)
                    self._skip_whitespace = True
                self._started = None
                self._pending, self._pending_at = body, at + verdict.end  # scanned again as content
            else:
                self._pending = self._pending[self._pending_at:] + text
                self._pending_at = 0
            opened = self._advance_outside_call(final)
            if opened is None:
                return
            text, start = opened

    def _call_body(self) -> tuple[str, int]:
        """The open call's text in one string (joined only if it came in pieces), and where it starts in it."""
        body = self._call_text[0] if len(self._call_text) == 1 else "".join(self._call_text)
        return body, self._call_start

    def _end_unfinished_call(self) -> None:
        body, at = self._call_body()
        self._emit_text(TOOL_CALL_OPEN + body[at:])
        self._scanner, self._call_text, self._section, self._started = None, [], _Section.CONTENT, None

    def _advance_outside_call(self, final: bool) -> tuple[str, int] | None:
        """Emit what pending text can be emitted; when a call opens, the text it opens in and where it starts,
        after `<tool_call>`. Only what is emitted is sliced off the pending text (scanning.py says why)."""
        while True:
            text, at = self._pending, self._pending_at
            if self._skip_whitespace:
                at = self._pending_at = skip_whitespace(text, at)
                if at == len(text):
                    return None
                self._skip_whitespace = False
            if self._section is _Section.START:
                if text.startswith(THINK_OPEN, at):
                    self._pending_at = at + len(THINK_OPEN)
                    self._section, self._skip_whitespace = _Section.REASONING, True
                    continue
                if len(text) - at < len(THINK_OPEN) and THINK_OPEN.startswith(text[at:]) and not final:
                    return None
                self._section = _Section.REASONING if self._starts_in_reasoning else _Section.CONTENT
                continue
            if self._section is _Section.REASONING:
                tag = THINK_CLOSE
            elif self._scanner_type is not None:
                tag = TOOL_CALL_OPEN
            else:
                self._emit_text(text[at:])
                self._pending, self._pending_at = "", 0
                return None
            found = text.find(tag, at)
            if found >= 0:
                self._emit_text(text[at:found])
                self._pending_at = found + len(tag)
                if self._section is _Section.REASONING:
                    self._flush_text()
                    self._section, self._skip_whitespace = _Section.CONTENT, True
                    continue
                self._section = _Section.TOOL_CALL
                self._scanner = self._scanner_type(self._tools, self._shared_by_scanners)
                self._pending, self._pending_at = "", 0
                return text, found + len(tag)
            held = 0 if final else partial_tag_len(text[max(at, len(text) - len(tag) + 1):], tag)
            self._emit_text(text[at:len(text) - held])
            self._pending, self._pending_at = text[len(text) - held:], 0
            return None
