"""Summary statistics of benchmark samples: small and dependency-free so the report can run anywhere."""
from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    return percentile(values, 50.0)


def summarize(values: Iterable[float | None]) -> dict[str, float | int]:
    """mean/min/max/median/stdev of the defined values; n counts them (None and NaN are skipped)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"n": 0, "mean": math.nan, "min": math.nan, "max": math.nan, "median": math.nan, "stdev": math.nan}
    mean = math.fsum(xs) / len(xs)
    stdev = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return {"n": len(xs), "mean": mean, "min": min(xs), "max": max(xs), "median": median(xs), "stdev": stdev}


def decode_rate(completion_tokens: int, wall_s: float, ttft_s: float | None, deltas: int = 2) -> float | None:
    """PERF.md's decode tok/s: completion_tokens / (wall − TTFT); None when undefined — also when the reply came
    in fewer than two deltas (a tool call the server sends whole at its end): then the tokens were decoded before
    the first delta, and the formula would divide them by the stream's last milliseconds."""
    if ttft_s is None or wall_s <= ttft_s or completion_tokens <= 0 or deltas < 2:
        return None
    return completion_tokens / (wall_s - ttft_s)


def prefill_rate(prompt_tokens: int, ttft_s: float | None) -> float | None:
    """PERF.md's prefill tok/s: prompt_tokens / TTFT. Cached tokens are not subtracted: the protocol salts
    prefill prompts so that nothing is cached."""
    if ttft_s is None or ttft_s <= 0 or prompt_tokens <= 0:
        return None
    return prompt_tokens / ttft_s
