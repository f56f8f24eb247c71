"""Which cached expert to evict: plain LRU, or an exponentially decayed hit count (LFU with decay).

A policy keeps one record per expert of a layer (resident or not, so an expert evicted by a scan comes back
with its history) and answers `victims(candidates, n)`: the n candidates to evict. Candidates exclude the
experts the current step needs (pinned). The clock ticks once per `access` call, i.e. once per layer forward.
"""
from __future__ import annotations

import torch


class LruPolicy:
    name = "lru"

    def __init__(self, num_experts: int):
        self.clock = 0
        self.last = torch.zeros(num_experts, dtype=torch.long)

    def access(self, experts: torch.Tensor) -> None:
        self.clock += 1
        self.last[experts] = self.clock

    def victims(self, candidates: torch.Tensor, n: int) -> list[int]:
        """The n least recently used experts among `candidates` (a bool mask [E])."""
        ids = candidates.nonzero().flatten()
        return ids[torch.argsort(self.last[ids], stable=True)[:n]].tolist()


class LfuDecayPolicy:
    """score(e) = sum over past accesses of decay ** (age in steps): frequency that fades, so a stable hot set
    scores ~1 / (1 - decay) while a one-off scan scores 1 and goes first. Ties: least recently used first."""
    name = "lfu-decay"

    def __init__(self, num_experts: int, decay: float = 0.9):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must lie in (0, 1), got {decay}")
        self.decay, self.clock = decay, 0
        self.score = torch.zeros(num_experts, dtype=torch.float64)
        self.stamp = torch.zeros(num_experts, dtype=torch.long)

    def _current(self, ids: torch.Tensor) -> torch.Tensor:
        return self.score[ids] * self.decay ** (self.clock - self.stamp[ids]).double()

    def access(self, experts: torch.Tensor) -> None:
        self.clock += 1
        self.score[experts] = self._current(experts) + 1.0
        self.stamp[experts] = self.clock

    def victims(self, candidates: torch.Tensor, n: int) -> list[int]:
        ids = candidates.nonzero().flatten()
        ids = ids[torch.argsort(self.stamp[ids], stable=True)]          # older first among equal scores
        return ids[torch.argsort(self._current(ids), stable=True)[:n]].tolist()


POLICIES = {LfuDecayPolicy.name: LfuDecayPolicy, LruPolicy.name: LruPolicy}


def make_policy(name: str, num_experts: int):
    if name not in POLICIES:
        raise ValueError(f"--expert-cache-policy {name!r} is not one of {', '.join(POLICIES)}")
    return POLICIES[name](num_experts)
