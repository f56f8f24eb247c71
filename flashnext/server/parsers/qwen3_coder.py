"""qwen3_coder XML tool calls (Qwen3-Coder-Next, Qwen3.5, Flash-Next):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

Values are raw text, typed afterwards by the tool's JSON schema (tool_schema.coerce_parameter).
"""
from __future__ import annotations

from enum import Enum

from flashnext.server.parsers.scanning import REJECTED, ScannedCall, ScanVerdict
from flashnext.server.parsers.tags import PENDING, TOOL_CALL_CLOSE, match_literal
from flashnext.server.parsers.tool_schema import ToolSchemas, coerce_parameter

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
# A function or parameter name longer than this is a model that lost the format, not a name.
MAX_NAME_LEN = 256


class _Expect(Enum):
    FUNCTION = "<function=NAME>"
    PARAMETER_OR_END = "<parameter=KEY>, </function> or </tool_call>"
    PARAMETER_NAME = "KEY>"
    VALUE = "VALUE</parameter>"
    TOOL_CALL_CLOSE = "</tool_call>"


class Qwen3CoderCallScanner:
    """A strict reading of the grammar above (one slip forgiven: a missing `</function>`): anything else
    between the tags rejects the call (it then reads as content). A value ends at the first
    `</parameter>`, so values may hold `</tool_call>`, `<function=` or any code. The scan resumes
    where it stopped: linear in the length of the call."""

    def __init__(self, tools: ToolSchemas):
        self._tools = tools
        self._expect = _Expect.FUNCTION
        self._pos = 0
        self._value_search_from = 0
        self._function = ""
        self._parameter = ""
        self._arguments: dict = {}

    def scan(self, text: str, final: bool) -> ScanVerdict:
        verdict = self._scan(text)
        return REJECTED if verdict is None and final else verdict

    def _scan(self, text: str) -> ScanVerdict:
        while True:
            if self._expect is _Expect.FUNCTION:
                end, _ = match_literal(text, self._pos, FUNCTION_OPEN)
                if end < 0:
                    return None if end == PENDING else REJECTED
                name, end = _read_name(text, end)
                if name is None or name is REJECTED:
                    return name
                if name not in self._tools:
                    return REJECTED
                self._function, self._pos, self._expect = name, end, _Expect.PARAMETER_OR_END
            elif self._expect is _Expect.PARAMETER_OR_END:
                # `</tool_call>` without `</function>` is a slip models make; the call is still whole.
                end, literal = match_literal(text, self._pos, PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
                if end < 0:
                    return None if end == PENDING else REJECTED
                if literal == TOOL_CALL_CLOSE:
                    return ScannedCall(name=self._function, arguments=self._arguments, end=end)
                self._pos = end
                self._expect = _Expect.PARAMETER_NAME if literal == PARAMETER_OPEN else _Expect.TOOL_CALL_CLOSE
            elif self._expect is _Expect.PARAMETER_NAME:
                name, end = _read_name(text, self._pos)
                if name is None or name is REJECTED:
                    return name
                self._parameter, self._pos, self._value_search_from = name, end, end
                self._expect = _Expect.VALUE
            elif self._expect is _Expect.VALUE:
                close = text.find(PARAMETER_CLOSE, self._value_search_from)
                if close < 0:
                    self._value_search_from = max(self._pos, len(text) - len(PARAMETER_CLOSE) + 1)
                    return None
                schema = self._tools.parameter_schema(self._function, self._parameter)
                # A repeated key: the last one wins, as in a JSON object.
                self._arguments[self._parameter] = coerce_parameter(text[self._pos:close], schema)
                self._pos, self._expect = close + len(PARAMETER_CLOSE), _Expect.PARAMETER_OR_END
            else:
                end, _ = match_literal(text, self._pos, TOOL_CALL_CLOSE)
                if end < 0:
                    return None if end == PENDING else REJECTED
                return ScannedCall(name=self._function, arguments=self._arguments, end=end)


def _read_name(text: str, pos: int):
    """The NAME of `NAME>` at pos and the position after `>`; (None, pos) if undecided, REJECTED if it
    cannot be a name (empty, spans a line or a tag, or too long)."""
    close = text.find(">", pos, pos + MAX_NAME_LEN + 1)
    if close < 0:
        tail = text[pos:pos + MAX_NAME_LEN + 1]
        if len(tail) > MAX_NAME_LEN or "<" in tail or "\n" in tail:
            return REJECTED, pos
        return None, pos
    raw = text[pos:close]
    if "<" in raw or "\n" in raw or not raw.strip():
        return REJECTED, pos
    return raw.strip(), close + 1
