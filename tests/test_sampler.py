"""Sampler: distributions of each knob, exact logit edits, logprobs, greedy, seeds, no host sync."""
from __future__ import annotations

import pytest
import torch

from flashnext.engine.sampler import (SamplingBatch, apply_top_k_top_p, process_logits, sample,
                                      validate_token_ids)
from flashnext.engine.sampling_params import InvalidParams, SamplingParams

V = 11  # odd on purpose
BASE = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3, 1.2, -3.0])


def build(params, outputs=None, prompts=None, vocab=V, eos=(), generators=None, device="cpu"):
    n = len(params)
    return SamplingBatch.build(params, outputs or [[] for _ in range(n)], prompts or [[] for _ in range(n)],
                               vocab, device, eos_token_ids=eos, generators=generators)


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The renormalised distribution, one token at a time in plain Python."""
    probs = (logits.double() / temperature).softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    keep = order[:top_k] if top_k > 0 else order
    total = sum(probs[i] for i in keep)
    kept, mass = [], 0.0
    for i in keep:
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i] / total
    best = max(probs[i] for i in kept)
    kept = [i for i in kept if probs[i] >= min_p * best]
    out = torch.zeros(len(probs), dtype=torch.float64)
    out[kept] = torch.tensor([probs[i] for i in kept], dtype=torch.float64)
    return out / out.sum()


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    support = expected_probs > 0
    n = counts.sum().double()
    expected = expected_probs[support] * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


KNOBS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.5, 0, 1.0, 0.0),
    (2.5, 0, 1.0, 0.0),
    (1.0, 3, 1.0, 0.0),
    (1.0, 0, 0.72, 0.0),
    (1.0, 0, 1.0, 0.15),
    (0.7, 6, 0.85, 0.05),
    (1.3, 4, 1.0, 0.3),
    (1.0, 1, 1.0, 0.0),
]


def test_distributions_match_reference_in_one_mixed_batch():
    draws = 3000
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in KNOBS for _ in range(draws)]
    params.insert(5, SamplingParams(temperature=0.0))  # a greedy row in the middle must not disturb the others
    batch = build(params)
    logits = BASE.repeat(len(params), 1)
    tokens = sample(logits, batch, generator=torch.Generator().manual_seed(0)).token_ids
    assert tokens[5] == BASE.argmax()
    assert_draws_follow_reference(torch.cat([tokens[:5], tokens[6:]]).view(len(KNOBS), draws), KNOBS)


def assert_draws_follow_reference(tokens: torch.Tensor, knobs) -> None:
    """tokens [len(knobs), draws]: each knob's row draws only allowed tokens, at the reference's frequencies."""
    for (t, k, p, m), row in zip(knobs, tokens):
        expected = reference_probs(BASE, t, k, p, m)
        counts = torch.bincount(row, minlength=V)
        assert counts[expected == 0].sum() == 0, f"excluded token drawn for {(t, k, p, m)}"
        assert chi_square_p_value(counts, expected) > 1e-4, (t, k, p, m, counts, expected * len(row))


def test_top_k_cuts_ties_by_rank():
    logits = torch.zeros(2, 7)
    out = apply_top_k_top_p(logits, torch.tensor([3, 7]), None)
    assert torch.isfinite(out).sum(-1).tolist() == [3, 7]
    assert torch.isfinite(out[0, :3]).all()


@pytest.mark.parametrize("vocab", [63, 100, 1001])
def test_candidate_path_picks_what_the_vocabulary_path_picks(vocab):
    """Seeded rows draw the same noise on both paths (a vocabulary's worth from their generator), so the same
    token comes out exactly when the truncations on the top_k_max candidates equal those on the vocabulary."""
    from flashnext.engine.sampler import _sample_candidates, _sample_vocabulary

    torch.manual_seed(vocab)
    knobs = [(1, 0.5, 0.0), (7, 1.0, 0.0), (13, 0.9, 0.1), (40, 0.3, 0.0), (3, 0.99, 0.4)]
    params = [SamplingParams(temperature=0.8, top_k=k, top_p=p, min_p=m, seed=i) for i, (k, p, m) in enumerate(knobs)]
    by_candidates, by_vocabulary = build(params, vocab=vocab), build(params, vocab=vocab)
    assert by_candidates.top_k_max == 40
    for _ in range(30):
        logits = torch.randn(len(params), vocab) * 2
        assert torch.equal(_sample_candidates(logits.clone(), by_candidates, None),
                           _sample_vocabulary(logits.clone(), by_vocabulary, None))
    assert build([SamplingParams(top_k=k) for k in (5, 9)], vocab=vocab).top_k_max == 9
    assert build([SamplingParams(top_k=5), SamplingParams(top_p=0.5)], vocab=vocab).top_k_max is None
    assert build([SamplingParams(top_k=5), SamplingParams(temperature=0.0)], vocab=vocab).top_k_max == 5


def test_candidate_path_distributions_match_reference():
    """Every random row with a top_k: `sample` takes the candidate path; each knob's draws follow the reference."""
    draws = 3000
    knobs = [k for k in KNOBS if k[1] > 0]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in knobs for _ in range(draws)]
    params.insert(3, SamplingParams(temperature=0.0))
    batch = build(params)
    assert batch.top_k_max == max(k for _, k, _, _ in knobs)
    tokens = sample(BASE.repeat(len(params), 1), batch, generator=torch.Generator().manual_seed(1)).token_ids
    assert tokens[3] == BASE.argmax()
    assert_draws_follow_reference(torch.cat([tokens[:3], tokens[4:]]).view(len(knobs), draws), knobs)


def test_greedy_takes_exact_argmax_of_processed_logits():
    torch.manual_seed(1)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.7, logit_bias={4: 0.3}),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.0, top_k=2, top_p=0.3)]
    outputs = [[1, 1, 2], [], [5]]
    batch = build(params, outputs=outputs, prompts=[[3], [], []], vocab=37)
    logits = torch.randn(3, 37)
    processed = process_logits(logits.clone(), batch)
    tokens = sample(logits, batch).token_ids
    assert tokens[0] == processed[0].argmax() and tokens[2] == processed[2].argmax()


def test_penalties_follow_their_formulas():
    torch.manual_seed(2)
    vocab = 37
    params = [SamplingParams(repetition_penalty=1.3),
              SamplingParams(repetition_penalty=0.8, presence_penalty=0.5),
              SamplingParams(frequency_penalty=0.7),
              SamplingParams(presence_penalty=-1.2, frequency_penalty=-0.4, repetition_penalty=2.0),
              SamplingParams()]
    prompts = [[0, 1, 2, 2], [5, 6], [7], [8, 9, 10], [11, 12]]
    outputs = [[3, 3, 30], [6, 6, 6, 20], [7, 7, 21, 22, 7], [9, 36], [13, 13]]
    batch = build(params, outputs=outputs, prompts=prompts, vocab=vocab)
    logits = torch.randn(5, vocab) * 3
    got = process_logits(logits.clone(), batch)
    for i, p in enumerate(params):
        want = logits[i].clone()
        for t in set(prompts[i]) | set(outputs[i]):
            want[t] = want[t] / p.repetition_penalty if want[t] > 0 else want[t] * p.repetition_penalty
        for t in set(outputs[i]):
            want[t] -= p.frequency_penalty * outputs[i].count(t) + p.presence_penalty
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)


def test_append_matches_a_rebuild():
    params = [SamplingParams(repetition_penalty=1.2, presence_penalty=0.3), SamplingParams(frequency_penalty=1.0)]
    prompts = [[1, 2], [3]]
    steps = [[4, 5], [4, 4], [1, 9]]
    batch = build(params, prompts=prompts)
    for step in steps:
        batch.append(torch.tensor(step))
    outputs = [[s[i] for s in steps] for i in range(2)]
    rebuilt = build(params, outputs=outputs, prompts=prompts)
    assert torch.equal(batch.seen, rebuilt.seen)
    assert torch.equal(batch.output_counts, rebuilt.output_counts)
    assert torch.equal(batch.num_generated, rebuilt.num_generated)


def test_logit_bias_adds_and_can_force_a_token():
    torch.manual_seed(3)
    params = [SamplingParams(logit_bias={2: 1.5, 9: -4.0}), SamplingParams(logit_bias={7: 100.0}), SamplingParams()]
    batch = build(params)
    logits = torch.randn(3, V)
    got = process_logits(logits.clone(), batch)
    want = logits.clone()
    want[0, 2] += 1.5
    want[0, 9] -= 4.0
    want[1, 7] += 100.0
    assert torch.equal(got, want)
    assert sample(logits, batch).token_ids[1] == 7


def _greedy_run(params, eos, steps, vocab=V):
    """Greedy decode on logits that prefer eos (3), then stop token 5, then 0."""
    logits = torch.full((len(params), vocab), -5.0)
    logits[:, 3], logits[:, 5], logits[:, 0] = 9.0, 8.0, 7.0
    batch = build(params, eos=eos, vocab=vocab)
    out = []
    for _ in range(steps):
        tokens = sample(logits.clone(), batch).token_ids
        batch.append(tokens)
        out.append(tokens.tolist())
    return [list(col) for col in zip(*out)]


def test_min_tokens_forbids_eos_and_stop_tokens_until_reached():
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
              SamplingParams(temperature=0.0, min_tokens=2),
              SamplingParams(temperature=0.0)]
    runs = _greedy_run(params, eos=[3], steps=4)
    assert runs[0] == [0, 0, 0, 3]
    assert runs[1] == [5, 5, 3, 3]  # 5 is no stop token of this request
    assert runs[2] == [3, 3, 3, 3]


def test_ignore_eos_leaves_eos_unmasked_but_stop_tokens_masked():
    # With ignore_eos, eos is an ordinary token (it will not end the request), so min_tokens has no reason
    # to forbid it; the request's own stop_token_ids still end it and stay forbidden.
    params = [SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[5]),
              SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)]
    logits = torch.full((2, V), -5.0)
    logits[:, 5], logits[:, 0] = 9.0, 7.0
    batch = build(params, eos=[5])
    assert sample(logits.clone(), batch).token_ids.tolist() == [0, 5]
    assert _greedy_run(params, eos=[3], steps=1) == [[3], [3]]


def test_min_tokens_resumes_from_generated_tokens():
    params = [SamplingParams(temperature=0.0, min_tokens=3)]
    logits = torch.zeros(1, V)
    logits[0, 3] = 5.0
    assert sample(logits.clone(), build(params, outputs=[[0, 0]], eos=[3])).token_ids.item() == 0
    assert sample(logits.clone(), build(params, outputs=[[0, 0, 0]], eos=[3])).token_ids.item() == 3


def test_logprobs_are_log_softmax_of_processed_logits():
    torch.manual_seed(4)
    vocab = 53
    params = [SamplingParams(temperature=0.5, top_k=4, logprobs=3, repetition_penalty=1.5, logit_bias={1: 2.0}),
              SamplingParams(temperature=0.0, logprobs=5, frequency_penalty=0.5),
              SamplingParams(temperature=1.2, top_p=0.5),
              SamplingParams(temperature=0.9, min_p=0.1, logprobs=0)]
    batch = build(params, outputs=[[1, 2], [3, 3], [], [4]], prompts=[[5], [6], [7], [8]], vocab=vocab)
    logits = torch.randn(4, vocab) * 2
    want = process_logits(logits.clone(), batch).log_softmax(-1)
    out = sample(logits, batch)
    torch.testing.assert_close(out.logprobs, want.gather(1, out.token_ids[:, None]).squeeze(1))
    ids, values = out.top_logprobs
    assert ids.shape == (4, 5)
    torch.testing.assert_close(values, want.topk(5, dim=-1).values)
    torch.testing.assert_close(want.gather(1, ids), values)


def test_no_logprobs_unless_asked():
    out = sample(torch.randn(2, V), build([SamplingParams(), SamplingParams(temperature=0.0)]))
    assert out.logprobs is None and out.top_logprobs is None
    out = sample(torch.randn(1, V), build([SamplingParams(logprobs=0)]))
    assert out.logprobs is not None and out.top_logprobs is None


def test_out_of_vocabulary_ids_are_rejected_in_user_words():
    validate_token_ids(SamplingParams(logit_bias={V - 1: 1.0}, stop_token_ids=[0]), V)
    with pytest.raises(InvalidParams) as e:
        validate_token_ids(SamplingParams(logit_bias={V: 1.0}), V)
    assert e.value.param == "logit_bias" and str(V) in str(e.value)
    with pytest.raises(InvalidParams) as e:
        validate_token_ids(SamplingParams(stop_token_ids=[-1]), V)
    assert e.value.param == "stop_token_ids"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sample_and_append_do_not_sync_with_the_host():
    vocab = 1001
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7, logprobs=4,
                             repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1,
                             logit_bias={3: 1.0}, min_tokens=2, stop_token_ids=[9]),
              SamplingParams(temperature=0.0), SamplingParams()]
    batch = build(params, prompts=[[1, 2], [3], []], vocab=vocab, eos=[0], device="cuda")
    logits = torch.randn(3, vocab, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out = sample(logits.clone(), batch)
            batch.append(out.token_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
