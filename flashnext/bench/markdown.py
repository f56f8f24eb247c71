"""Markdown tables for results: one helper so every benchmark's table looks the same."""
from __future__ import annotations

import math


def num(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def vs_floor(value: float | None, floor: float | None) -> list[str]:
    """The two columns every rate gets: the floor and the fraction of it reached."""
    if floor is None:
        return ["n/a", "n/a"]
    pct = "n/a" if value is None or math.isnan(value) else f"{100 * value / floor:.1f}%"
    return [num(floor, 0), pct]
