"""Stop strings over streamed text: cut the output at the first stop string, even one split across tokens."""
from __future__ import annotations


class StopStringMatcher:
    """Feed the newly decoded text of each step; get back what may be emitted and the stop that matched.

    Unless include_stop_str_in_output, the longest tail of the text that could still begin a stop string is
    held back, so no part of a stop string is ever emitted; `flush` releases it when generation ends
    without a match. With include_stop_str_in_output nothing is held back (the stop would be emitted
    anyway), but the tail is still searched. After a match, the text after the stop is dropped and the
    matcher is done.

    When several stop strings occur, the one that ends first wins (ties: the longer one); that is the one
    a token-by-token stream would see complete first, so the result never depends on how the text was cut
    into tokens.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        assert all(stop), "empty stop strings are rejected by SamplingParams"
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._longest = max((len(s) for s in self.stop), default=0)
        self._window = ""  # the last (longest - 1) characters seen: where a stop string may have begun
        self._held = 0     # how many characters at the end of the window have not been emitted
        self.done = False

    def feed(self, new_text: str) -> tuple[str, str | None]:
        """Returns (text to emit now, the stop string that matched or None)."""
        assert not self.done, "feed after a stop string matched or after flush"
        buf = self._window + new_text
        unemitted = len(self._window) - self._held
        match = self._first_match(buf, len(self._window))
        if match is not None:
            start, stop = match
            self.done = True
            end = start + len(stop) if self.include_stop_str_in_output else start
            assert end >= unemitted, "a stop string never begins in text already emitted unless it is kept"
            return buf[unemitted:end], stop
        hold = 0 if self.include_stop_str_in_output else self._could_begin_stop(buf)
        assert len(buf) - hold >= unemitted, "a held tail only ever grows within the unemitted text"
        keep = self._longest - 1
        self._window = buf[max(0, len(buf) - keep):] if keep > 0 else ""
        self._held = hold
        return buf[unemitted:len(buf) - hold], None

    def flush(self) -> str:
        """The held-back text, once generation ended for another reason."""
        assert not self.done
        self.done = True
        return self._window[len(self._window) - self._held:]

    def _first_match(self, buf: str, old: int) -> tuple[int, str] | None:
        # Only matches ending in the new text: anything inside the old window was searched before.
        best = None
        for s in self.stop:
            pos = buf.find(s, max(0, old - len(s) + 1))
            if pos >= 0:
                key = (pos + len(s), -len(s))
                if best is None or key < best[0]:
                    best = key, pos, s
        return None if best is None else best[1:]

    def _could_begin_stop(self, buf: str) -> int:
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[len(buf) - k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
