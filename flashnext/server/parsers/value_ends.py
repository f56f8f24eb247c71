"""Whether a qwen3_coder value, read the first way (qwen3_coder.py), runs to the end of a finished generation.

Each call that a finished generation still holds asks it of its values; reading a value to the end answered it in
time linear in the rest of the text, so a generation of calls that slip, each read again and each followed by
the next, was quadratic (2,000 of them, 226K characters: 2.9 s at finish, on the server's event loop). Built
once over the rest of the text, this answers for a value in log time, once per KEY the tool declares that occurs
after a `</parameter>` in the text.

A value's tags are events: `\\n<parameter=` opens a nested pair (+1), `</parameter>` closes one (-1); at the
value's own level a `</parameter>` closes nothing but may end the value, and is text otherwise, so the level
never goes below the value's. With S[i] the sum of the steps before event i, the value whose first event is v is
at its own level at event j >= v exactly when no event k in [v, j) has S[k] < S[j], that is when the last such
event before j, below[j], is before v. The value ends at a `</parameter>` at its own level that is followed by
`</function>`, `</tool_call>` or `<parameter=KEY>` with KEY one the tool declares (any KEY if it declares none),
and runs to the end if there is none.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection


class _Ends:
    def __repr__(self) -> str:
        return "ENDS"


# What follows a `</parameter>` (after whitespace) when it is `</function>` or `</tool_call>`: it ends any value.
ENDS = _Ends()


class _Closes:
    """`</parameter>`s of one kind, by event index, with the least `below` from each on."""

    def __init__(self):
        self.events: list[int] = []
        self.least_below: list[int] = []

    def one_at_own_level(self, v: int) -> bool:
        """Whether one of them, at or after event v, is at the level of a value whose first event is v."""
        i = bisect_left(self.events, v)
        return i < len(self.events) and self.least_below[i] < v


class ValueEnds:
    """events: (position, step, after) in text order from start: step +1 for `\\n<parameter=`, -1 for
    `</parameter>`; after, for a `</parameter>`, ENDS, the KEY of a `<parameter=KEY>` after it, or None (text,
    or the generation ended before it was decided). Positions are kept counted back from the end, so that a
    scanner holding any later suffix of the finished text can ask."""

    def __init__(self, text: str, start: int, events: list[tuple[int, int, object]]):
        self._from = start - len(text)
        self._at = [position - len(text) for position, _, _ in events]
        self._ends, self._any_key = _Closes(), _Closes()
        self._by_key: dict[str, _Closes] = {}
        level, levels, rising = 0, [], []  # rising: events whose levels rise, the last one below the next event
        for j, (_, step, after) in enumerate(events):
            while rising and levels[rising[-1]] >= level:
                rising.pop()
            below = rising[-1] if rising else -1
            rising.append(j)
            levels.append(level)
            level += step
            if after is ENDS:
                kinds = [self._ends]
            elif isinstance(after, str):
                kinds = [self._any_key, self._by_key.setdefault(after, _Closes())]
            else:
                kinds = []
            for closes in kinds:
                closes.events.append(j)
                closes.least_below.append(below)
        for closes in (self._ends, self._any_key, *self._by_key.values()):
            for i in reversed(range(len(closes.least_below) - 1)):
                closes.least_below[i] = min(closes.least_below[i], closes.least_below[i + 1])

    def covers(self, text: str, pos: int) -> bool:
        return pos - len(text) >= self._from

    def runs_to_end(self, text: str, pos: int, declared: Collection[str]) -> bool:
        """Whether the value that starts at pos of text (a suffix of the finished text) runs to its end."""
        v = bisect_left(self._at, pos - len(text))
        if self._ends.one_at_own_level(v):
            return False
        if not declared:
            return not self._any_key.one_at_own_level(v)
        keys, other = (declared, self._by_key) if len(declared) <= len(self._by_key) else (self._by_key, declared)
        return not any(self._by_key[key].one_at_own_level(v) for key in keys if key in other)
