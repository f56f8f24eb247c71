"""What a request asks of generation: the sampling knobs and the stop rules.

Validation lives here so the server and the Python API reject the same things with the same words.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashnext.engine.structured import StructuredOutput


class InvalidParams(ValueError):
    """A request parameter a user set is out of range; the message names the parameter."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int | None = 16          # None: up to the context limit
    temperature: float = 1.0             # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None          # None: no logprobs; k: the chosen token plus top-k
    n: int = 1
    structured: StructuredOutput | None = None   # constrained decoding (JSON, forced tool calls)

    def __post_init__(self):
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParams("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidParams("temperature", f"temperature must be in [0, 100], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParams("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise InvalidParams("top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}.")
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParams("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidParams("repetition_penalty", f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidParams(name, f"{name} must be in [-2, 2], got {value}.")
        if self.min_tokens < 0:
            raise InvalidParams("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParams("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidParams("logprobs", f"top_logprobs must be in [0, 20], got {self.logprobs}.")
        if self.n < 1 or self.n > 16:
            raise InvalidParams("n", f"n must be in [1, 16], got {self.n}.")
        # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; choice i of n samples with seed + i
        if self.seed is not None and not -2**63 <= self.seed <= 2**64 - self.n:
            raise InvalidParams("seed", f"seed must be in [-2**63, 2**64 - n], got {self.seed}.")
        if any(not s for s in self.stop):
            raise InvalidParams("stop", "stop strings must not be empty.")
        for token_id, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise InvalidParams("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}.")
        self.constrain(self.structured)

    def constrain(self, structured: StructuredOutput | None) -> None:
        """Set the output constraint. ignore_eos and min_tokens cannot go with one: a constrained output ends where its
        grammar ends (generating past it, the grammar matcher fails the engine step)."""
        if structured is not None and (self.ignore_eos or self.min_tokens):
            name = "ignore_eos" if self.ignore_eos else "min_tokens"
            raise InvalidParams(name, f"{name} cannot be combined with {structured.param}'s constrained output "
                                      f"({structured.kind}): it ends where its grammar does.")
        self.structured = structured

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
