"""Replay a routing trace through a cache policy without a model: the hit rate a slot budget would get.

A trace is a sequence of steps, each the distinct expert ids one layer needs in that step (what
`LayerExpertCache.load` sees). Benchmarks use it to compare policies on traces of stated locality.
"""
from __future__ import annotations

import torch

from flashnext.cache.expert_policy import make_policy


def replay(trace, num_experts: int, num_slots: int, policy: str = "lfu-decay") -> tuple[int, int]:
    """→ (hits, misses) of a `num_slots` cache under `policy`; the experts of a step are pinned."""
    chooser = make_policy(policy, num_experts)
    resident = torch.zeros(num_experts, dtype=torch.bool)
    hits = misses = 0
    for step in trace:
        need = torch.tensor(sorted(set(step)), dtype=torch.long)
        if len(need) > num_slots:
            raise ValueError(f"a step needs {len(need)} experts; the cache holds {num_slots}")
        chooser.access(need)
        missing = need[~resident[need]]
        hits += len(need) - len(missing)
        misses += len(missing)
        evict = len(missing) - (num_slots - int(resident.sum()))
        if evict > 0:
            candidates = resident.clone()
            candidates[need] = False
            resident[chooser.victims(candidates, evict)] = False
        resident[missing] = True
    return hits, misses
