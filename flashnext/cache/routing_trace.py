"""Routing with stated locality, for benchmarking the expert cache on random-weight models.

Random weights route uniformly: the worst case for a cache, and not what a trained model does. With
`--routing-trace calibrated` every router keeps its own logits but the experts it picks come from
`CalibratedRouting`, whose per-layer locality matches what is published for Flash-Next: a per-layer LRU of 64
experts hits ~67%, of 128 ~81%, and there is no static hot set (the working set drifts). Each of a token's k
choices re-uses a recently used expert with probability `reuse` — the r-th most recent, r drawn geometrically
with ratio `decay` — or else is uniform over all experts. Outputs of a model run this way are not the model's:
the mode exists for `flashnext bench experts` and says so in the log. A captured decode step cannot call into
Python, so its routers read `decode_ids`: a table drawn ahead on the device, stepped by a device counter.
"""
from __future__ import annotations

import math
import random
from collections import OrderedDict

import torch

REUSE, DECAY = 0.80, 0.973   # fitted: LRU-64 67.2%, LRU-128 81.5% at 512 experts, top-10 (2,000 tokens)
TRACES = ("calibrated",)
# Tokens drawn ahead for captured decode steps (decode_ids; ~30 µs a token in Python: ~12 s for Flash-Next's 48
# routers, once): a benchmark's decode fits in them; past their end the steps wrap around to the first.
DECODE_TABLE_TOKENS = 8192


class CalibratedRouting:
    def __init__(self, num_experts: int, top_k: int, seed: int = 0, reuse: float = REUSE, decay: float = DECAY):
        self.num_experts, self.top_k, self.reuse, self.log_decay = num_experts, top_k, reuse, math.log(decay)
        self.rng = random.Random(seed)
        order = list(range(num_experts))
        self.rng.shuffle(order)
        self.recent: OrderedDict[int, None] = OrderedDict((e, None) for e in order)   # most recent last
        self.decode_table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (ids, next, rows)

    def _recent(self, rank: int) -> int:
        for i, expert in enumerate(reversed(self.recent)):
            if i == rank:
                return expert
        return next(iter(self.recent))

    def choose(self) -> list[int]:
        """One token's k distinct experts; they become the most recent."""
        picks: list[int] = []
        while len(picks) < self.top_k:
            if self.rng.random() < self.reuse:
                rank = min(int(math.log(1.0 - self.rng.random()) / self.log_decay), self.num_experts - 1)
                expert = self._recent(rank)
            else:
                expert = self.rng.randrange(self.num_experts)
            if expert not in picks:
                picks.append(expert)
        for expert in picks:
            self.recent.move_to_end(expert)
        return picks

    def ids(self, num_tokens: int, device) -> torch.Tensor:
        """[num_tokens, k] int64 expert ids, token after token."""
        return torch.tensor([self.choose() for _ in range(num_tokens)], dtype=torch.long, device=device)

    def decode_ids(self, num_rows: int, device) -> torch.Tensor:
        """[num_rows, k] ids of one decode step, with no host work (a captured step replays it): the next num_rows
        tokens of a table drawn ahead on first use (DECODE_TABLE_TOKENS tokens, token after token, shared by every
        batch size), from a position on the device that the step advances."""
        if self.decode_table is None:
            self.decode_table = (self.ids(DECODE_TABLE_TOKENS, device), torch.zeros(1, dtype=torch.long, device=device),
                                 torch.arange(DECODE_TABLE_TOKENS, device=device))
        table, position, rows = self.decode_table
        ids = table.index_select(0, (position + rows[:num_rows]).remainder(len(table)))
        position.add_(num_rows)
        return ids


def install_routing_trace(model: torch.nn.Module, kind: str, seed: int = 0) -> int:
    """Give every router of `model` its own trace; returns how many."""
    from flashnext.models.layers.moe import Router

    if kind not in TRACES:
        raise ValueError(f"--routing-trace {kind!r} is not one of {', '.join(TRACES)}")
    routers = [m for m in model.modules() if isinstance(m, Router)]
    for i, router in enumerate(routers):
        router.trace = CalibratedRouting(router.weight.shape[0], router.top_k, seed=seed * 1000 + i)
    return len(routers)
