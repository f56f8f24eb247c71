"""Seeded requests draw the same tokens whoever shares their batch, across batch rebuilds."""
from __future__ import annotations

import torch

from flashnext.engine.sampler import SamplingBatch, sample
from flashnext.engine.sampling_params import SamplingParams

V = 53
LOGITS = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 0.5  # flat-ish: draws vary a lot


def run(schedule, target: SamplingParams, batch_seed: int) -> list[int]:
    """Decode `target` through batches of changing composition; schedule: (neighbours, index of target, steps)."""
    generator = torch.Generator().manual_seed(batch_seed)
    tokens: list[int] = []
    target_gen = None
    for neighbours, at, steps in schedule:
        params = list(neighbours)
        params.insert(at, target)
        outputs = [[] for _ in params]
        outputs[at] = list(tokens)
        gens: list = [None] * len(params)
        gens[at] = target_gen
        batch = SamplingBatch.build(params, outputs, [[1, 2]] * len(params), V, "cpu", generators=gens)
        target_gen = batch.generators[at]
        for _ in range(steps):
            out = sample(LOGITS.repeat(len(params), 1), batch, generator=generator)
            batch.append(out.token_ids)
            tokens.append(out.token_ids[at].item())
    return tokens


def test_same_seed_same_tokens_whatever_the_batch():
    target = SamplingParams(temperature=1.0, seed=1234, top_k=40)
    alone = run([([], 0, 20)], target, batch_seed=0)
    unseeded, seeded = SamplingParams(temperature=0.9), SamplingParams(temperature=1.0, seed=99)
    greedy = SamplingParams(temperature=0.0)
    mixed = run([([unseeded, seeded], 1, 7),
                 ([seeded, greedy, unseeded, unseeded], 3, 5),
                 ([SamplingParams(seed=1234)], 0, 8)], target, batch_seed=5)
    assert mixed == alone


def test_different_seeds_differ_and_unseeded_rows_follow_the_batch_generator():
    a = run([([], 0, 20)], SamplingParams(seed=1), batch_seed=0)
    b = run([([], 0, 20)], SamplingParams(seed=2), batch_seed=0)
    assert a != b
    c = run([([], 0, 20)], SamplingParams(), batch_seed=3)
    assert c == run([([], 0, 20)], SamplingParams(), batch_seed=3)
    assert c != run([([], 0, 20)], SamplingParams(), batch_seed=4)


def test_seeded_rows_in_one_batch_are_independent_of_order():
    params = [SamplingParams(seed=s) for s in (5, 6, 7)] + [SamplingParams()]
    order = [3, 2, 0, 1]
    first = sample(LOGITS.repeat(4, 1), SamplingBatch.build(params, [[]] * 4, [[]] * 4, V, "cpu")).token_ids
    shuffled = [params[i] for i in order]
    second = sample(LOGITS.repeat(4, 1), SamplingBatch.build(shuffled, [[]] * 4, [[]] * 4, V, "cpu")).token_ids
    assert [second[order.index(i)].item() for i in range(3)] == first[:3].tolist()
