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


def replay_optimal(trace, num_experts: int, num_slots: int) -> tuple[int, int]:
    """→ (hits, misses) of a `num_slots` cache that knows the future (Bélády: evict the resident expert used again
    last, or never): the most any policy — prefetch or prediction included, on these slots — can hit on the trace."""
    steps = [sorted(set(step)) for step in trace]
    if any(not 0 <= e < num_experts for step in steps for e in step):
        raise ValueError(f"an expert id outside 0..{num_experts - 1}")
    never = len(steps)
    next_use: list[dict[int, int]] = [{} for _ in steps]   # step → {expert: the step that needs it next}
    upcoming = {}
    for t in range(len(steps) - 1, -1, -1):
        for expert in steps[t]:
            next_use[t][expert] = upcoming.get(expert, never)
            upcoming[expert] = t
    resident: dict[int, int] = {}   # expert → the step it is needed next
    hits = misses = 0
    for t, need in enumerate(steps):
        if len(need) > num_slots:
            raise ValueError(f"a step needs {len(need)} experts; the cache holds {num_slots}")
        missing = [e for e in need if e not in resident]
        hits += len(need) - len(missing)
        misses += len(missing)
        for expert in need:
            resident[expert] = next_use[t][expert]
        for _ in range(len(resident) - num_slots):
            victim = max((e for e in resident if e not in need), key=lambda e: resident[e])
            del resident[victim]
    return hits, misses
