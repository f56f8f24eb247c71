"""Batched sampling on the device: from the logits of one decode step to one token per request.

`SamplingBatch.build` turns the requests' `SamplingParams` into per-batch tensors once, when the batch
composition changes; `sample` is then tensor ops over the whole batch with no host sync (the only Python
branching is on flags fixed at build time), and `SamplingBatch.append` updates the token counts on the
device after each step.

Order of operations (as vLLM): logit_bias, min_tokens, penalties -> logprobs -> temperature, top_k, top_p,
min_p -> sample.
- Logprobs are the log_softmax of the logits after bias/min_tokens/penalties and before temperature and
  the truncations: what the request's own edits make of the model distribution, independent of how it is
  then sampled (OpenAI reports the model's distribution, not the sampler's).
- top_k, top_p, min_p are applied one after the other, each on the distribution the previous one left
  (renormalised); min_p commutes with top_k but not with top_p.
- Greedy rows (temperature 0) take the exact argmax of the processed logits.
- Random rows draw with the exponential race: argmax(probs / E), E ~ Exponential(1) i.i.d., picks token i
  with probability probs[i]. A row whose request has a seed draws its E from its own torch.Generator, so
  its tokens depend only on its seed and its own history, never on its neighbours in the batch.
  Rows without a seed share one batch generator.
- When every random row has a top_k (agents' usual top_k 20), the truncations and the race run on each row's
  top_k_max best logits after one topk, not on the vocabulary (`_sample_candidates`): the same distribution,
  and for a seeded row the same token (it still draws a vocabulary's worth of noise and reads its candidates';
  ties at the top_k boundary aside, which topk and the stable sort may break differently).

CUDA graphs: everything in `sample` is capturable except the per-seeded-row generator draws, which need
the generators registered with the graph (`torch.cuda.CUDAGraph.register_generator_state`); the engine
decides that, not this module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashnext.engine.penalties import apply_logit_bias, apply_min_tokens, apply_penalties
from flashnext.engine.sampling_params import InvalidParams, SamplingParams

# E = 0 happens with probability ~2^-24 per draw in float32; probs / 0 would be inf (or nan for an excluded
# token, which argmax would pick), so E is clamped: a distribution change of that order, far below noise.
_MIN_EXPONENTIAL = 1e-20


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Reject token ids outside the vocabulary, in the user's words; call when a request is admitted."""
    for name, ids in (("logit_bias", params.logit_bias.keys()), ("stop_token_ids", params.stop_token_ids)):
        bad = sorted(i for i in ids if not 0 <= i < vocab_size)
        if bad:
            raise InvalidParams(name, f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}.")


@dataclass
class SamplerOutput:
    """token_ids LongTensor [B]; logprobs float32 [B] of the chosen tokens; top_logprobs (ids LongTensor
    [B, k], values float32 [B, k]) best first, k the largest `logprobs` asked for in the batch (each request
    keeps its first params.logprobs columns). logprobs is None when no request asked; top_logprobs too, or
    when k is 0."""
    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


def _rows_cols(pairs: list[tuple[int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).to(device)
    return t[:, 0], t[:, 1]


@dataclass(eq=False)
class SamplingBatch:
    """The sampling state of the B requests of a batch, row i = request i, all tensors on `device`.

    Optional tensors are None when no request of the batch needs them, and `sample` then skips that step.
    """
    vocab_size: int
    temperature: torch.Tensor            # float32 [B], 1.0 on greedy rows
    greedy: torch.Tensor                 # bool [B]
    top_k: torch.Tensor | None           # long [B], vocab_size where disabled
    top_k_max: int | None                # largest top_k when every random row has one: sample among that many
    top_p: torch.Tensor | None           # float32 [B], inf where disabled (rounding in the cumsum never cuts)
    min_p: torch.Tensor | None           # float32 [B], 0 where disabled
    repetition_penalty: torch.Tensor     # float32 [B]
    presence_penalty: torch.Tensor       # float32 [B]
    frequency_penalty: torch.Tensor      # float32 [B]
    seen: torch.Tensor | None            # bool [B, V]: prompt + generated tokens (repetition_penalty)
    output_counts: torch.Tensor | None   # int32 [B, V]: generated tokens (presence/frequency penalties)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None     # rows, cols, values
    stop_ids: tuple[torch.Tensor, torch.Tensor] | None  # rows, cols of stop tokens of rows with min_tokens > 0
    min_tokens: torch.Tensor             # long [B]
    num_generated: torch.Tensor          # long [B]
    generators: list[torch.Generator | None]  # per request; keep them across rebuilds for reproducibility
    max_logprobs: int | None             # largest `logprobs` asked for, None when no request asked
    all_greedy: bool
    any_greedy: bool

    @classmethod
    def build(cls, params: list[SamplingParams], output_token_ids: list[list[int]],
              prompt_token_ids: list[list[int]], vocab_size: int, device: torch.device | str,
              eos_token_ids: list[int] | tuple[int, ...] = (),
              generators: list[torch.Generator | None] | None = None) -> SamplingBatch:
        """Build the tensors for a batch; call again whenever requests join or leave it.

        output_token_ids[i]: the tokens request i has generated so far (counts and min_tokens resume from
        them); prompt_token_ids[i]: its prompt (repetition_penalty covers it). eos_token_ids count as stop
        tokens for min_tokens unless the request sets ignore_eos (then eos neither ends it nor is masked).
        generators[i]: request i's generator from the previous batch it was in; None (or no list) makes a
        fresh one from params[i].seed for a seeded random request. Token ids must have passed
        `validate_token_ids`.
        """
        n = len(params)
        assert len(output_token_ids) == n and len(prompt_token_ids) == n
        f32 = dict(dtype=torch.float32, device=device)
        greedy = [p.greedy for p in params]

        gens: list[torch.Generator | None] = list(generators) if generators is not None else [None] * n
        for i, p in enumerate(params):
            if gens[i] is None and p.seed is not None and not p.greedy:
                gens[i] = torch.Generator(device=device).manual_seed(p.seed)

        def token_counts(pairs: list[tuple[int, int]]) -> torch.Tensor:
            t = torch.zeros(n, vocab_size, dtype=torch.int32, device=device)
            rows, cols = _rows_cols(pairs, device)
            t.index_put_((rows, cols), torch.ones(len(pairs), dtype=torch.int32, device=device), accumulate=True)
            return t

        seen = output_counts = None
        if any(p.repetition_penalty != 1.0 for p in params):
            pairs = [(i, t) for i in range(n) for t in (*prompt_token_ids[i], *output_token_ids[i])]
            seen = token_counts(pairs) > 0
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            output_counts = token_counts([(i, t) for i in range(n) for t in output_token_ids[i]])

        bias = None
        bias_items = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
        if bias_items:
            rows, cols = _rows_cols([(i, t) for i, t, _ in bias_items], device)
            bias = rows, cols, torch.tensor([b for *_, b in bias_items], **f32)

        stop_ids = None
        stop_pairs = [(i, t) for i, p in enumerate(params) if p.min_tokens > len(output_token_ids[i])
                      for t in sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)))]
        if stop_pairs:
            stop_ids = _rows_cols(stop_pairs, device)

        any_top_k = any(0 < p.top_k < vocab_size and not p.greedy for p in params)
        any_top_p = any(p.top_p < 1.0 and not p.greedy for p in params)
        any_min_p = any(p.min_p > 0.0 and not p.greedy for p in params)
        random_top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params if not p.greedy]
        logprob_ks = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            vocab_size=vocab_size,
            temperature=torch.tensor([1.0 if p.greedy else p.temperature for p in params], **f32),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                               dtype=torch.long, device=device) if any_top_k else None,
            top_k_max=max(random_top_ks) if any_top_k and max(random_top_ks) < vocab_size else None,
            top_p=torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], **f32)
            if any_top_p else None,
            min_p=torch.tensor([p.min_p for p in params], **f32) if any_min_p else None,
            repetition_penalty=torch.tensor([p.repetition_penalty for p in params], **f32),
            presence_penalty=torch.tensor([p.presence_penalty for p in params], **f32),
            frequency_penalty=torch.tensor([p.frequency_penalty for p in params], **f32),
            seen=seen,
            output_counts=output_counts,
            bias=bias,
            stop_ids=stop_ids,
            min_tokens=torch.tensor([p.min_tokens for p in params], dtype=torch.long, device=device),
            num_generated=torch.tensor([len(o) for o in output_token_ids], dtype=torch.long, device=device),
            generators=gens,
            max_logprobs=max(logprob_ks) if logprob_ks else None,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
        )

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    def append(self, token_ids: torch.Tensor) -> None:
        """Record the tokens just sampled (LongTensor [B], on the device) in the counts; no host sync."""
        self.num_generated += 1
        rows = torch.arange(self.num_rows, device=token_ids.device)
        if self.seen is not None:  # a python True would be copied from the host, a sync
            self.seen.index_put_((rows, token_ids), torch.ones_like(token_ids, dtype=torch.bool))
        if self.output_counts is not None:
            self.output_counts.index_put_((rows, token_ids), torch.ones_like(token_ids, dtype=torch.int32),
                                          accumulate=True)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias, min_tokens and penalties, in place on logits [B, V] float32; returns logits."""
    if batch.bias is not None:
        apply_logit_bias(logits, *batch.bias)
    if batch.stop_ids is not None:
        apply_min_tokens(logits, *batch.stop_ids, batch.num_generated, batch.min_tokens)
    apply_penalties(logits, batch.seen, batch.repetition_penalty,
                    batch.output_counts, batch.presence_penalty, batch.frequency_penalty)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the top_k[i] best tokens of row i, then the smallest best-first set whose probability reaches
    top_p[i]; the rest become -inf. Ties are cut by rank, so exactly k tokens stay.
    Works on a sorted copy (one sort serves both, no per-row shape leaves the device). When every random row
    has a top_k, `sample` does not come here: it works on the top_k_max best logits only (_sample_candidates)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    _truncate_sorted(sorted_logits, top_k, top_p)
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def _truncate_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """top_k, then top_p, in place on logits sorted best first."""
    if top_k is not None:
        ranks = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
        sorted_logits.masked_fill_(ranks >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the best token has 0 before it, so it always stays
        sorted_logits.masked_fill_(mass_before >= top_p[:, None], float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p[i] times the row's best probability."""
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None) -> SamplerOutput:
    """One token per row of logits [B, V] float32 (edited in place by `process_logits`).

    generator: the batch generator for rows without a seed (None: torch's default generator of the device).
    """
    assert logits.dtype == torch.float32 and logits.shape == (batch.num_rows, batch.vocab_size), logits.shape
    process_logits(logits, batch)
    logprobs_all = logits.log_softmax(dim=-1) if batch.max_logprobs is not None else None

    if batch.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        token_ids = (_sample_candidates(logits, batch, generator) if batch.top_k_max is not None
                     else _sample_vocabulary(logits, batch, generator))
        if batch.any_greedy:
            token_ids = torch.where(batch.greedy, logits.argmax(dim=-1), token_ids)

    out = SamplerOutput(token_ids)
    if logprobs_all is not None:
        out.logprobs = logprobs_all.gather(1, token_ids[:, None]).squeeze(1)
        if batch.max_logprobs > 0:
            top = logprobs_all.topk(batch.max_logprobs, dim=-1)
            out.top_logprobs = (top.indices, top.values)
    return out


def _sample_vocabulary(logits: torch.Tensor, batch: SamplingBatch, generator) -> torch.Tensor:
    """The exponential race over the whole vocabulary (some random row has no top_k)."""
    scaled = logits / batch.temperature[:, None]
    if batch.top_k is not None or batch.top_p is not None:
        scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    return _race(scaled, batch, generator)


def _sample_candidates(logits: torch.Tensor, batch: SamplingBatch, generator) -> torch.Tensor:
    """The same distribution when every random row has a top_k: one topk over the vocabulary (top_k_max
    candidates per row, best first), then the truncations, the softmax and the race over [B, top_k_max] only —
    no kernel over the vocabulary after the topk (softmax, noise, division and argmax over 248K logits were each
    a pass over the row). Temperature > 0 does not change which logits are the best. Unseeded rows draw
    top_k_max numbers from the batch generator; a seeded row draws a whole vocabulary's from its own and reads
    its candidates' (_race), so it picks the token the full path would."""
    values, order = logits.topk(batch.top_k_max, dim=-1)
    scaled = values / batch.temperature[:, None]
    _truncate_sorted(scaled, batch.top_k, batch.top_p)
    return order.gather(1, _race(scaled, batch, generator, order)[:, None]).squeeze(1)


def _race(scaled: torch.Tensor, batch: SamplingBatch, generator, order: torch.Tensor | None = None) -> torch.Tensor:
    """min_p, then argmax(probs / E) over the columns of `scaled` (the vocabulary, or the candidates `order` names):
    E ~ Exponential(1) from the batch generator, or for a seeded row from its own."""
    if batch.min_p is not None:
        scaled = apply_min_p(scaled, batch.min_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, gen in enumerate(batch.generators):
        if gen is not None:
            # a vocabulary's worth whichever path samples the row: the same numbers for its seed and history
            row_noise = torch.empty(batch.vocab_size, dtype=probs.dtype, device=probs.device).exponential_(generator=gen)
            noise[row] = row_noise if order is None else row_noise[order[row]]
    return probs.div_(noise.clamp_min_(_MIN_EXPONENTIAL)).argmax(dim=-1)
