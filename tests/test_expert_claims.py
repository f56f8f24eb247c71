"""ops/expert_claims.py: the admission rule on a small pool step by step (LRU victims, an expert routed twice
counted and admitted once, padding rows skipped, the admitted made resident by the next call, no victim when every
resident is routed), and the Triton program (interpreted on CPU) equal to the reference over random steps."""
import random

import pytest
import torch

from flashnext.ops import expert_claims
from flashnext.ops.expert_claims import claim_slots_reference


def state(num_experts: int, residents: dict[int, int]):
    table = torch.full((num_experts,), -1, dtype=torch.long)
    for e, slot in residents.items():
        table[e] = slot
    return table, torch.zeros(num_experts, dtype=torch.long), torch.zeros(1, dtype=torch.long), \
        torch.zeros(3, dtype=torch.long)


IMPLEMENTATIONS = [claim_slots_reference, expert_claims._claim_launch]


@pytest.mark.parametrize("claim_slots_reference", IMPLEMENTATIONS, ids=["reference", "program"])
def test_admission_rule_step_by_step(claim_slots_reference):
    table, last, clock, counts = state(8, {0: 0, 1: 1, 2: 2})
    # step 1: 0 hits; 5 misses and takes the least recently used resident not routed now (1: ties → lower id)
    claim_slots_reference(table, last, clock, counts, torch.tensor([[0, 5]]), None)
    assert table.tolist() == [0, -1, 2, -1, -1, -3, -1, -1] and counts.tolist() == [1, 1, 1]
    # step 2: 5 becomes resident; 6 and 6 again (two rows): one miss, takes 2 (last used 0); the padding row's 7 skipped
    claim_slots_reference(table, last, clock, counts, torch.tensor([[6, 5], [6, 0], [7, 7]]), torch.tensor([2]))
    assert table[5] == 1 and table[6] == -4 and table[2] == -1 and table[7] == -1
    assert counts.tolist() == [1 + 2, 1 + 1, 1 + 1] and last[7] == 0 and clock.item() == 2
    # step 3: every resident (0, 5, 6) routed: 3 misses read from host, not admitted
    claim_slots_reference(table, last, clock, counts, torch.tensor([[0, 5], [6, 3]]), None)
    assert table.tolist()[:7] == [0, -1, -1, -1, -1, 1, 2] and counts.tolist() == [3 + 3, 2 + 1, 2]


@pytest.mark.parametrize("claim", IMPLEMENTATIONS, ids=["reference", "program"])
def test_a_resident_routed_later_in_the_step_is_not_evicted(claim):
    table, last, clock, counts = state(8, {0: 0, 1: 1, 2: 2})
    claim(table, last, clock, counts, torch.tensor([[0, 2]]), None)
    claim(table, last, clock, counts, torch.tensor([[5, 1]]), None)     # 5 misses before 1 is met: 1 stays
    assert table[1] == 1 and table[5] == -(0 + 2) and table[0] == -1 and counts.tolist() == [3, 1, 1]


def run(fn, steps, num_experts, slots, seed):
    rng = random.Random(seed)
    table, last, clock, counts = state(num_experts, {e: s for s, e in enumerate(rng.sample(range(num_experts), slots))})
    history = []
    for _ in range(steps):
        rows, k = rng.randrange(1, 5), 3
        ids = torch.tensor([[rng.randrange(num_experts) for _ in range(k)] for _ in range(rows)])
        live = torch.tensor([rng.randrange(1, rows + 1)], dtype=torch.int32) if rng.random() < 0.5 else None
        fn(table, last, clock, counts, ids, live)
        history.append((table.clone(), last.clone(), clock.clone(), counts.clone()))
    return history


@pytest.mark.parametrize("num_experts,slots", [(37, 9), (7, 3)])   # 7 and 3: often every resident routed
def test_the_program_equals_the_reference(num_experts, slots):
    for seed in range(3):
        want = run(claim_slots_reference, 12, num_experts, slots, seed)
        got = run(expert_claims._claim_launch, 12, num_experts, slots, seed)
        for a, b in zip(want, got):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        for table, *_ in want:     # no slot held twice (resident or admitted), none lost
            held = torch.where(table <= -2, -table - 2, table)
            held = held[held >= 0]
            assert sorted(held.tolist()) == list(range(slots))


@pytest.mark.parametrize("claim", IMPLEMENTATIONS, ids=["reference", "program"])
def test_choices_of_weight_zero_claim_nothing(claim):
    """Expert parallel's choices of other ranks (weight 0, skipped by the MoE kernels) are not routed: not marked
    used, not counted, not admitted."""
    table = torch.tensor([0, -1, -1, 1], dtype=torch.long)
    last, clock, counts = torch.zeros(4, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    ids = torch.tensor([[2, 1], [3, 2]])
    weights = torch.tensor([[0.0, 0.5], [0.7, 0.0]])
    claim(table, last, clock, counts, ids, None, weights)
    assert counts.tolist() == [1, 1, 1]             # expert 3 hit, expert 1 missed and admitted; expert 2 not routed
    assert last.tolist() == [0, 1, 0, 1]
    assert table.tolist()[2] == -1 and table.tolist()[1] <= -2
