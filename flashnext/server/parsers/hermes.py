"""Hermes tool calls (Qwen3, Qwen3-Next): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`."""
from __future__ import annotations

import re
from dataclasses import replace

from flashnext.server.parsers.scanning import UNFINISHED, Rejected, ScannedCall, ScanVerdict
from flashnext.server.parsers.tags import MISMATCH, PENDING, TOOL_CALL_CLOSE, match_literal, skip_whitespace
from flashnext.server.parsers.tool_schema import INVALID, ToolSchemas, parse_json

_IN_STRING = re.compile(r'["\\]')
_OUTSIDE_STRING = re.compile(r'[{}"<]')
# A call whose object opens with its name (as the templates and the forced-choice grammar write it) names its function
# before its arguments: `name` looks for it in the object's first NAME_LOOKAHEAD characters, and no further.
_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
NAME_LOOKAHEAD = 512


class HermesCallScanner:
    """Finds the end of the JSON object by tracking strings and brace depth, so a `</tool_call>` written
    inside an argument string does not cut the call short. The object's text is kept as pieces and parsed
    once it closes; between pieces, only an escape or a `</tool_call>` cut by a piece's end is looked at
    again."""

    def __init__(self, tools: ToolSchemas, shared: dict | None = None):
        self._tools = tools
        self._text = ""  # what may still be looked at; what came before it is consumed
        self._offset = 0  # where _text starts in the call
        self._pos = 0  # in _text: where the scan resumes
        self._object: list[str] | None = None  # the object's text before _start, once its `{` is seen
        self._start = 0  # in _text: where the object's text not yet in _object starts
        self._depth = 0
        self._in_string = False
        self._call: tuple[str, dict] | None = None
        self._name: str | None = None
        self._name_looked = False  # found, or NAME_LOOKAHEAD passed: `name` looks no more

    @property
    def held_chars(self) -> int:
        return len(self._text)

    @property
    def name(self) -> str | None:
        """The function an object that opens with `"name": "…"` names, once that string has closed and names one of
        the tools (ToolCallScanner.name; an object that puts its name later names it at its end)."""
        if self._name_looked or self._object is None:
            return self._name
        head = "".join(self._object)   # at most NAME_LOOKAHEAD characters and a piece: looked at no further
        match = _NAME_FIRST.match(head)
        if match is not None:
            name = parse_json(match.group(1))
            self._name = name if isinstance(name, str) and name in self._tools else None
            self._name_looked = True
        elif len(head) > NAME_LOOKAHEAD:
            self._name_looked = True
        return self._name

    def scan(self, more: str, final: bool, start: int = 0) -> ScanVerdict:
        if self._text:
            self._text += more
        else:  # not copied: a call's first piece is the rest of the text chat_output holds (a rejection hands it back)
            self._text, self._pos, self._offset = more, start, self._offset - start
        verdict = self._scan(self._text)
        if verdict is not None:
            return replace(verdict, end=verdict.end + self._offset)
        if self._object is not None and self._call is None:
            self._object.append(self._text[self._start:self._pos])
        self._text = self._text[self._pos:]
        self._offset += self._pos
        self._pos = self._start = 0
        return UNFINISHED if final else None

    def _scan(self, text: str) -> ScannedCall | Rejected | None:
        """The verdict, with its end in text, once the text decides it; None until then. An object that is not a
        call is rejected at its end, so no call opens in its strings."""
        if self._object is None:
            self._pos = skip_whitespace(text, self._pos)
            if self._pos == len(text):
                return None
            if text[self._pos] != "{":
                return Rejected(self._pos)
            self._object, self._start, self._pos, self._depth = [], self._pos, self._pos + 1, 1
        while self._call is None:
            if self._in_string:
                match = _IN_STRING.search(text, self._pos)
                if match is None:
                    self._pos = len(text)
                    return None
                if match.group() == '"':
                    self._in_string = False
                    self._pos = match.end()
                elif match.end() == len(text):  # a backslash whose escaped character has not arrived
                    self._pos = match.start()
                    return None
                else:
                    self._pos = match.end() + 1
                continue
            match = _OUTSIDE_STRING.search(text, self._pos)
            if match is None:
                self._pos = len(text)
                return None
            self._pos = match.end()
            char = match.group()
            if char == '"':
                self._in_string = True
            elif char == "{":
                self._depth += 1
            elif char == "}":
                self._depth -= 1
                if self._depth == 0:
                    self._call = self._read_call("".join(self._object) + text[self._start:self._pos])
                    if self._call is None:
                        return Rejected(self._pos)
            else:  # `<` outside a string: not JSON, whatever follows (e.g. `</tool_call>` before the last `}`)
                return Rejected(match.start())
        self._pos = skip_whitespace(text, self._pos)
        end, _ = match_literal(text, self._pos, TOOL_CALL_CLOSE)
        if end == PENDING:
            return None
        if end == MISMATCH:
            return Rejected(self._pos)
        return ScannedCall(name=self._call[0], arguments=self._call[1], end=end)

    def _read_call(self, text: str) -> tuple[str, dict] | None:
        obj = parse_json(text)
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        if not isinstance(name, str) or name not in self._tools:
            return None
        # Some fine-tunes write "parameters", or the arguments as a JSON string (OpenAI's wire shape).
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = parse_json(arguments) if arguments.strip() else {}
        if arguments is INVALID or not isinstance(arguments, dict):
            return None
        return name, arguments
