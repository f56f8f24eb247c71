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

Where a value ends. Values are code, templates and tests that may hold this format's own tags, so the first
`</parameter>` is not always the end. The first reading applies the two rules vLLM's qwen3_coder parser has for
it (its tests' cases are in tests/test_parsers_literal_tags.py):
- a `</parameter>` ends the value only when `</function>`, `</tool_call>` or `<parameter=KEY>` follows it
  (after whitespace), KEY a parameter the tool declares (any KEY if it declares none); otherwise it is text
  (`end = "</parameter>"` in code, a template quoting the format);
- a `<parameter=` at the start of a line inside a value opens a nested pair whose `</parameter>` is text (a
  value quoting a whole call, as a parser's test fixture does).
When the generation ends inside a value, the model slipped, and the value left open is read a second time,
more loosely (the values before it stay as the first reading closed them): a `<parameter=KEY>` after
`</parameter>` counts whatever KEY is (a key the tool lacks, which vLLM instead folds into the value before
it), and a line-start `<parameter=KEY>` of a declared parameter not given yet ends the value too (a model that
left out `</parameter>`). Only such a call waits for the end of the generation, and a generation cut at
max_tokens is not read again (chat_output.py). At the end of a generation, whether a value runs to the end is
looked up rather than read (value_ends.py): the text after each call that slipped is scanned for calls again,
and reading each of their last values to the end was quadratic.
"""
from __future__ import annotations

import re
from dataclasses import replace
from enum import Enum

from flashnext.server.parsers.scanning import UNFINISHED, Rejected, ScannedCall, ScanVerdict
from flashnext.server.parsers.tags import MISMATCH, PENDING, TOOL_CALL_CLOSE, match_literal, skip_whitespace
from flashnext.server.parsers.tool_schema import ToolSchemas, coerce_parameter
from flashnext.server.parsers.value_ends import ENDS, ValueEnds

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
# A function or parameter name longer than this is a model that lost the format, not a name.
MAX_NAME_LEN = 256

_NESTED_OPEN = "\n" + PARAMETER_OPEN
_VALUE_TAGS = re.compile(f"{re.escape(PARAMETER_CLOSE)}|{re.escape(_NESTED_OPEN)}")
# Text at the end that may be the start of a value tag, and so is searched again with the next piece.
_VALUE_TAG_HOLD = max(len(PARAMETER_CLOSE), len(_NESTED_OPEN)) - 1


class _Expect(Enum):
    FUNCTION = "<function=NAME>"
    PARAMETER_OR_END = "<parameter=KEY>, </function> or </tool_call>"
    PARAMETER_NAME = "KEY>"
    VALUE = "VALUE</parameter>"
    AFTER_CLOSE = "<parameter=, </function> or </tool_call> after </parameter>, else it was text"
    TOOL_CALL_CLOSE = "</tool_call>"


class Qwen3CoderCallScanner:
    """A strict reading of the grammar above, but for a missing `</function>` (and the second reading's
    slips): anything else between the tags rejects the call (it then reads as content). Consumed text is not
    looked at again but by the second reading, except the current value's, kept as pieces and joined once when
    the value ends."""

    def __init__(self, tools: ToolSchemas, shared: dict | None = None, recovering: bool = False):
        self._tools = tools
        self._shared = shared  # holds the ValueEnds of a finished generation, for its later calls
        self._recovering = recovering  # the second reading: a line-start <parameter=KEY> may end a value
        self._received: list[str] = []  # the call as handed in, for the second reading
        self._received_start = 0  # where the call starts in _received[0]
        self._open_at = 0  # in the call: where the latest `<parameter=` starts (the open value's, at the end)
        self._text = ""  # what may still be looked at; what came before it is consumed
        self._offset = 0  # where _text starts in the call
        self._pos = 0  # in _text: where the element now expected starts
        self._expect = _Expect.FUNCTION
        self._function = ""
        self._parameter = ""
        self._arguments: dict = {}
        self._value: list[str] = []  # the current value's text before _pos
        self._search_from = 0  # in a value: where the search for its tags resumes
        self._depth = 0  # nested <parameter= … </parameter> pairs open in the current value
        self._close: list[str] = []  # `</parameter>` and the whitespace after it, until AFTER_CLOSE decides

    @property
    def held_chars(self) -> int:
        return len(self._text)

    @property
    def name(self) -> str | None:
        """Set once `<function=NAME>` is read and NAME is one of the tools (ToolCallScanner.name)."""
        return self._function or None

    def scan(self, more: str, final: bool, start: int = 0) -> ScanVerdict:
        if not self._recovering and len(more) > start:
            if not self._received:
                self._received_start = start
            self._received.append(more)
        if self._text:
            self._text += more
        else:  # not copied: at the end of a generation, each call it still holds is handed all the rest
            self._text, self._pos, self._search_from = more, start, start
            self._offset -= start
        verdict = self._scan(final)
        if verdict is not None:
            return replace(verdict, end=verdict.end + self._offset)
        if not final:  # at the end nothing is looked at again, and the rest is not copied
            self._drop_consumed()
            return None
        if self._expect in (_Expect.VALUE, _Expect.AFTER_CLOSE) and not self._recovering:
            return self._read_open_value_again()
        return UNFINISHED

    def _read_open_value_again(self) -> ScanVerdict:
        """The second reading, from the `<parameter=` of the value left open to the end."""
        again = Qwen3CoderCallScanner(self._tools, recovering=True)
        # nothing enters _arguments while a value is open: they are the arguments before it
        again._function, again._arguments = self._function, dict(self._arguments)
        again._expect = _Expect.PARAMETER_OR_END
        text = self._received[0] if len(self._received) == 1 else "".join(self._received)
        verdict = again.scan(text, final=True, start=self._received_start + self._open_at)
        return verdict if verdict is UNFINISHED else replace(verdict, end=verdict.end + self._open_at)

    def _runs_to_end(self, text: str, pos: int) -> bool:
        """Whether the value starting at pos runs to the end of the text, which is the generation's end."""
        if self._shared is None:   # the second reading (and a scanner without a generation's shared state)
            return False
        ends = self._shared.get(ValueEnds)
        if ends is None or not ends.covers(text, pos):
            ends = self._shared[ValueEnds] = ValueEnds(text, pos, _value_events(text, pos))
        return ends.runs_to_end(text, pos, self._tools.parameter_names(self._function))

    def _drop_consumed(self) -> None:
        if self._expect is _Expect.VALUE:
            self._value.append(self._text[self._pos:self._search_from])
            self._pos = self._search_from
        cut = self._pos
        self._text = self._text[cut:]
        self._offset += cut
        self._pos = self._search_from = 0

    def _scan(self, final: bool) -> ScannedCall | Rejected | None:
        """The verdict, with its end in _text, once the text decides it; None until then."""
        text = self._text
        while True:
            if self._expect is _Expect.FUNCTION:
                self._pos = skip_whitespace(text, self._pos)
                end, _ = match_literal(text, self._pos, FUNCTION_OPEN)
                if end < 0:
                    return None if end == PENDING else Rejected(self._pos)
                name, end = _read_name(text, end)
                if name is None:
                    return None
                if name is _NOT_A_NAME or name not in self._tools:
                    return Rejected(self._pos)
                self._function, self._pos, self._expect = name, end, _Expect.PARAMETER_OR_END
            elif self._expect is _Expect.PARAMETER_OR_END:
                self._pos = skip_whitespace(text, self._pos)
                # `</tool_call>` without `</function>` is a slip models make; the call is still whole.
                end, literal = match_literal(text, self._pos, PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
                if end < 0:
                    return None if end == PENDING else Rejected(self._pos)
                if literal == TOOL_CALL_CLOSE:
                    return ScannedCall(name=self._function, arguments=self._arguments, end=end)
                if literal == PARAMETER_OPEN:
                    self._open_at = self._offset + end - len(PARAMETER_OPEN)
                self._pos = end
                self._expect = _Expect.PARAMETER_NAME if literal == PARAMETER_OPEN else _Expect.TOOL_CALL_CLOSE
            elif self._expect is _Expect.PARAMETER_NAME:
                name, end = _read_name(text, self._pos)
                if name is None:
                    return None
                if name is _NOT_A_NAME:
                    return Rejected(self._pos)
                self._start_value(name, end)
                if final and self._runs_to_end(text, end):
                    return None  # left open at the end: scan() reads it again
            elif self._expect is _Expect.VALUE:
                verdict = self._scan_value(text)
                if verdict is not _CONTINUE:
                    return verdict
            elif self._expect is _Expect.AFTER_CLOSE:
                start = skip_whitespace(text, self._pos)
                self._close.append(text[self._pos:start])
                self._pos = start
                ended = self._value_ended(text, start)
                if ended is None:
                    return None
                if ended:  # the tag at start is read again as PARAMETER_OR_END
                    self._end_value("".join(self._value))
                    self._expect = _Expect.PARAMETER_OR_END
                else:  # the `</parameter>` was text of the value
                    self._value += self._close
                    self._expect, self._search_from = _Expect.VALUE, start
                    # a line-start <parameter= right after it, whose newline the tag search will not see again
                    if text.startswith(PARAMETER_OPEN, start) and "".join(self._close).endswith("\n"):
                        self._depth += 1
                        self._search_from = start + len(PARAMETER_OPEN)
            else:
                self._pos = skip_whitespace(text, self._pos)
                end, _ = match_literal(text, self._pos, TOOL_CALL_CLOSE)
                if end < 0:
                    return None if end == PENDING else Rejected(self._pos)
                return ScannedCall(name=self._function, arguments=self._arguments, end=end)

    def _scan_value(self, text: str):
        """Up to the `</parameter>` that may end the value (then AFTER_CLOSE decides), or the value's end in
        the second reading; None when the text runs out first."""
        while True:
            match = _VALUE_TAGS.search(text, self._search_from)
            if match is None:
                self._search_from = max(self._search_from, len(text) - _VALUE_TAG_HOLD)
                return None
            if match.group() == _NESTED_OPEN:
                if self._recovering:
                    name, end = _read_name(text, match.end())
                    if name is None:
                        self._search_from = match.start()
                        return None
                    if name is not _NOT_A_NAME and self._may_end_unclosed_value(name):
                        # the newline before the tag is the value's framing, stripped with it
                        self._end_value("".join(self._value) + text[self._pos:match.start() + 1])
                        self._start_value(name, end)
                        return _CONTINUE
                self._depth += 1
            elif self._depth:
                self._depth -= 1
            else:
                self._value.append(text[self._pos:match.start()])
                self._close = [PARAMETER_CLOSE]
                self._pos, self._expect = match.end(), _Expect.AFTER_CLOSE
                return _CONTINUE
            self._search_from = match.end()

    def _value_ended(self, text: str, pos: int) -> bool | None:
        """Whether the tag at pos, after a `</parameter>`, shows that it ended the value; None if undecided."""
        end, literal = match_literal(text, pos, PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
        if end == PENDING:
            return None
        if end == MISMATCH:
            return False
        if literal != PARAMETER_OPEN or self._recovering:
            return True
        name, _ = _read_name(text, end)
        if name is None:
            return None
        declared = self._tools.parameter_names(self._function)
        return name is not _NOT_A_NAME and (not declared or name in declared)

    def _may_end_unclosed_value(self, name: str) -> bool:
        return (name != self._parameter and name not in self._arguments
                and name in self._tools.parameter_names(self._function))

    def _start_value(self, name: str, end: int) -> None:
        self._parameter, self._pos, self._search_from = name, end, end
        self._value, self._depth, self._expect = [], 0, _Expect.VALUE

    def _end_value(self, raw: str) -> None:
        schema = self._tools.parameter_schema(self._function, self._parameter)
        # A repeated key: the last one wins, as in a JSON object.
        self._arguments[self._parameter] = coerce_parameter(raw, schema)
        self._value = []


_CONTINUE = object()  # _scan_value moved to another state: go on scanning
_NOT_A_NAME = object()


def _value_events(text: str, start: int) -> list[tuple[int, int, object]]:
    """The value tags from start, as ValueEnds takes them; what follows each `</parameter>` as the first reading's
    _value_ended reads it."""
    events = []
    for match in _VALUE_TAGS.finditer(text, start):
        if match.group() == _NESTED_OPEN:
            events.append((match.start(), 1, None))
            continue
        end, literal = match_literal(text, match.end(), PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
        if end < 0:
            after = None
        elif literal != PARAMETER_OPEN:
            after = ENDS
        else:
            name, _ = _read_name(text, end)
            after = name if isinstance(name, str) else None
        events.append((match.start(), -1, after))
    return events


def _read_name(text: str, pos: int):
    """The NAME of `NAME>` at pos and the position after `>`; (None, pos) if undecided, _NOT_A_NAME if it
    cannot be a name (empty, spans a line or a tag, or too long)."""
    close = text.find(">", pos, pos + MAX_NAME_LEN + 1)
    if close < 0:
        tail = text[pos:pos + MAX_NAME_LEN + 1]
        if len(tail) > MAX_NAME_LEN or "<" in tail or "\n" in tail:
            return _NOT_A_NAME, pos
        return None, pos
    raw = text[pos:close]
    if "<" in raw or "\n" in raw or not raw.strip():
        return _NOT_A_NAME, pos
    return raw.strip(), close + 1
