"""One request inside the engine: its tokens, how many are computed, its state handles, its output."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flashnext.engine.outputs import RequestMetrics, TokenLogprob
from flashnext.engine.sampling_params import SamplingParams
from flashnext.engine.stop_strings import StopStringMatcher
from flashnext.tokenizer.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from flashnext.engine.structured.backend import StructuredConstraint


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    max_model_len: int
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0            # tokens whose KV / state is written
    num_cached: int = 0              # prompt tokens served from the prefix cache
    prefix_counted: bool = False     # admitted once: prefix cache stats and num_cached are set
    # Prompt tokens before the chat template's generation prompt: the furthest point the conversation's next
    # turn shares (the Qwen templates render a past reply without the think block the generation prompt
    # opened), so a prefill chunk ends there and the state is snapshotted. None: no such point known.
    history_len: int | None = None
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    constraint: StructuredConstraint | None = None   # params.structured, compiled; advanced per token
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.time()))
    # Not yet handed to the caller:
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self):
        self.stop_matcher = StopStringMatcher(self.params.stop, self.params.include_stop_str_in_output)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (a step asks once per request: at 64K tokens of prompt the
        copy was ~0.08 ms a request on the dev machine, an ad hoc timing not kept)."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:n] + self.output_ids[max(start - n, 0):stop - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """The gap scheduling closes: tokens known but not yet run through the model."""
        return self.num_tokens - self.num_computed

    @property
    def max_output(self) -> int:
        limit = self.max_model_len - len(self.prompt_ids)
        return min(limit, self.params.max_tokens) if self.params.max_tokens is not None else limit

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
