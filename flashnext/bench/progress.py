"""One status line per run on stderr: rewritten in place on a terminal, printed once when piped."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, stream=None, min_interval_s: float = 0.1):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.min_interval_s = min_interval_s
        self.label = ""
        self._width = 0
        self._last = 0.0

    def start(self, label: str) -> None:
        self.label = label
        self._width = 0
        self._last = 0.0
        self._write(f"{label} ...")

    def update(self, text: str) -> None:
        now = time.monotonic()
        if self.tty and now - self._last >= self.min_interval_s:
            self._last = now
            self._write(f"{self.label} {text}")

    def done(self, text: str) -> None:
        line = f"{self.label} {text}"
        if self.tty:
            self._write(line)
            self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own that stays (a warning, a phase change)."""
        if self.tty and self._width:
            self.stream.write("\n")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def _write(self, line: str) -> None:
        if not self.tty:
            return
        # Pad with spaces instead of an erase escape, so the line stays plain text.
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"
