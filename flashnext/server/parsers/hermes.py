"""Hermes tool calls (Qwen3, Qwen3-Next): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`."""
from __future__ import annotations

import re

from flashnext.server.parsers.scanning import REJECTED, ScannedCall, ScanVerdict
from flashnext.server.parsers.tags import MISMATCH, PENDING, TOOL_CALL_CLOSE, match_literal, skip_whitespace
from flashnext.server.parsers.tool_schema import INVALID, ToolSchemas, parse_json

_IN_STRING = re.compile(r'["\\]')
_OUTSIDE_STRING = re.compile(r'[{}"<]')


class HermesCallScanner:
    """Finds the end of the JSON object by tracking strings and brace depth, so a `</tool_call>` written
    inside an argument string does not cut the call short. The scan resumes where it stopped, so a long
    call costs linear time however finely it is streamed."""

    def __init__(self, tools: ToolSchemas):
        self._tools = tools
        self._start: int | None = None  # where the object's `{` is
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._object_end: int | None = None
        self._call: tuple[str, dict] | None = None

    def scan(self, text: str, final: bool) -> ScanVerdict:
        verdict = self._scan(text)
        return REJECTED if verdict is None and final else verdict

    def _scan(self, text: str) -> ScanVerdict:
        if self._start is None:
            pos = skip_whitespace(text, 0)
            if pos == len(text):
                return None
            if text[pos] != "{":
                return REJECTED
            self._start, self._pos, self._depth = pos, pos + 1, 1
        while self._object_end is None:
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
                    self._object_end = self._pos
            else:  # `<` outside a string: not JSON, whatever follows (e.g. `</tool_call>` before the last `}`)
                return REJECTED
        if self._call is None:
            call = self._read_call(text[self._start:self._object_end])
            if call is None:
                return REJECTED
            self._call = call
        end, _ = match_literal(text, self._object_end, TOOL_CALL_CLOSE)
        if end == PENDING:
            return None
        if end == MISMATCH:
            return REJECTED
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
