"""A step's sampled tokens on their way to the host, so that reading them waits for that step alone.

`Tensor.tolist()` of a CUDA tensor waits for everything queued on the stream, and with decode ahead
(LLMEngine.step) the next decode step is queued behind this one before the host reads this one's tokens. So the
tokens (and log-probabilities) are copied to page-locked host memory right behind their step, an event marks the
copies' end, and reading waits for that event only.
"""
from __future__ import annotations

import torch

from flashnext.engine.sampler import SamplerOutput


class SampledOnHost:
    def __init__(self, sampled: SamplerOutput):
        top = sampled.top_logprobs or (None, None)
        # non_blocking from a CUDA tensor allocates the host copy page-locked, so the copy is asynchronous
        self._copies = [None if t is None else t.to("cpu", non_blocking=True)
                        for t in (sampled.token_ids, sampled.logprobs, *top)]
        self._done = None
        if sampled.token_ids.is_cuda:   # on the copies' stream: the current device may be another GPU
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(sampled.token_ids.device))

    def lists(self) -> tuple[list[int], list[float] | None, tuple[list[list[int]], list[list[float]]] | None]:
        """(token ids, their log-probabilities or None, (top ids, top log-probabilities) or None), per row."""
        if self._done is not None:
            self._done.synchronize()
        tokens, logprobs, top_ids, top_values = (None if t is None else t.tolist() for t in self._copies)
        return tokens, logprobs, (top_ids, top_values) if top_ids is not None else None
