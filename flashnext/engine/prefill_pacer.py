"""How many prefill tokens a step may carry while other sequences decode, from a step-time budget.

Every running stream waits for the whole step, so a step that also carries a long prefill chunk stalls them all
for as long as the chunk takes. With `--decode-step-budget-ms` the scheduler sizes that chunk so a mixed step
takes about the budget: it keeps a moving average of decode-only step times and of the seconds per prefill token
seen in mixed steps (their time minus the decode share), and offers (budget − decode time) / seconds-per-token
tokens, between MIN_TOKENS (smaller chunks waste the GEMMs) and the fixed `--prefill-budget-while-decoding`.
Steps are timed by the engine once their sampled tokens reach the host (so the GPU has finished them).
"""
from __future__ import annotations

MIN_TOKENS = 64
SMOOTHING = 0.3   # weight of the newest measurement in the moving averages


class PrefillPacer:
    def __init__(self, budget_s: float, max_tokens: int):
        self.budget_s = budget_s
        self.max_tokens = max_tokens
        self.decode_s: float | None = None       # a decode-only step
        self.token_s: float | None = None        # one prefill token inside a mixed step

    def record(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """A finished step: its prefill tokens, decoding rows and wall time."""
        if decode_rows and not prefill_tokens:
            self.decode_s = _average(self.decode_s, seconds)
        elif prefill_tokens and decode_rows and self.decode_s is not None:
            self.token_s = _average(self.token_s, max(seconds - self.decode_s, 0.0) / prefill_tokens)

    def tokens(self) -> int:
        """Prefill tokens for the next step that has decodes in it."""
        if self.token_s is None or self.decode_s is None:
            return self.max_tokens            # nothing measured yet: the fixed budget
        room = max(self.budget_s - self.decode_s, 0.0)
        return int(min(self.max_tokens, max(MIN_TOKENS, room / max(self.token_s, 1e-9))))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
