"""Helpers the GPU check scripts share (they run from the repository root as `python3 scripts/NAME.py`, so this
imports as a plain module)."""
import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def agreeing_tokens(want, got) -> tuple[int, int]:
    """Greedy token streams (lists, or dicts of lists by request): (tokens equal before each stream's first
    difference, all tokens of `want`)."""
    if isinstance(want, dict):
        want, got = list(want.values()), [got[k] for k in want]
    same = sum(next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), len(w)) for w, g in zip(want, got))
    return same, sum(len(w) for w in want)
