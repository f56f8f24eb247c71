"""Runs one scheduled step through the model and samples the requests whose chunk reached their end.

This is the one place that turns scheduler output into tensors. Requests that decode one token — or feed one
prompt token of a sequence under way (Scheduler.graph_tail) — replay the captured decode graph when `graphs` is
given (engine/cuda_graph.py); short prompt chunks of a sequence under way replay its chained steps
(DecodeGraphs.extend); other prefill chunks run the eager torch path, in the same step, so running streams keep
their fast path while a long prompt enters — with `row_graphs`, a step of up to its rows replays its row-wise work
(engine/row_graphs.py).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.state_pool import StatePool
from flashnext.engine.cuda_graph import DecodeGraphs
from flashnext.engine.row_graphs import RowGraphs
from flashnext.engine.sampler import SamplerOutput, SamplingBatch, sample
from flashnext.engine.scheduler import ScheduledChunk
from flashnext.engine.structured.backend import apply_constraints
from flashnext.models.context import ForwardContext, Segment
from flashnext.weights.pinned import to_device


class ModelRunner:
    def __init__(self, model, kv: KVPool, states: StatePool, eos_token_ids, device, seed: int = 0,
                 graphs: DecodeGraphs | None = None, row_graphs: RowGraphs | None = None):
        self.model = model
        self.graphs = graphs
        self.row_graphs = row_graphs
        self.kv = kv
        self.states = states
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = torch.device(device)
        self.vocab_size = model.cfg.vocab_size
        # Requests without a seed share this generator: a server started with the same --seed replays.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # The last step's sampling batch, its requests and their output lengths, and the tokens it sampled: when
        # the next step samples the same requests one token further, the batch is advanced on the device
        # (SamplingBatch.append) instead of being rebuilt from Python lists (~10 host→device copies a step).
        self._last_batch: tuple[list[int], list[int], SamplingBatch, torch.Tensor] | None = None

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], launched: Callable[[], None] | None = None) -> SamplerOutput | None:
        """One step: one-token chunks of sequences under way (decodes, prompt tails) go through the captured graph
        (when there is one), short chunks of sequences under way through chained steps (DecodeGraphs.extend), the
        rest (prefill chunks) through the eager forward, in the same step; the chunks that sample are sampled in the
        order of `chunks`.
        `launched` is called once: after the graph replay when an existing graph runs the whole step, else first
        (before an eager forward or a graph capture, which may keep the host for a while)."""
        launched = launched or (lambda: None)
        requests = [c.request for c in chunks if c.samples]
        # A new sampling batch is built before the forward is queued: its small host→device copies then find the
        # GPU idle instead of waiting behind the step (a pageable copy blocks the host until it is done). The last
        # step's batch advanced by its tokens is device work only: queued after the forward, off the GPU's idle gap.
        appendable = bool(requests) and self._appendable(requests)
        batch = self._sampling_batch(requests, appendable) if requests and not appendable else None
        decoding = self._graph_chunks(chunks)   # prefill only: a prompt's last tokens fed one a step replay too
        replayed = {id(c) for c in decoding}
        extending = [c for c in chunks if c.chained]   # the scheduler sets it only where graphs run them
        replayed |= {id(c) for c in extending}
        eager = [c for c in chunks if id(c) not in replayed]
        replay_first = bool(decoding) and not eager and not extending and self.graphs.captured(
            len(decoding), max(len(c.request.blocks) for c in decoding))
        if not replay_first:
            launched()
        parts = []
        # Chained steps before the decode replay: an extend may end with the decode graph of the same batch and
        # width, whose static logits the replay would overwrite; extend's own logits are copies.
        for chunk in extending:
            r = chunk.request
            logits = self.graphs.extend(r.tokens(r.num_computed, r.num_computed + chunk.num_tokens), r.num_computed,
                                        r.slot, r.blocks)
            if chunk.samples:
                parts.append(([r], logits))
        if decoding:
            logits = self._replay([c.request for c in decoding])
            sampled = [c.request for c in decoding if c.samples]   # the first rows (_graph_chunks' order)
            if sampled:   # prompt tokens fed one a step come last: their logits are not wanted
                parts.append((sampled, logits[:len(sampled)]))
            if replay_first:
                launched()
        if eager:
            logits = self._forward_eager(eager)
            if logits is not None:
                parts.append(([c.request for c in eager if c.samples], logits))
        if not requests:
            return None
        if batch is None:
            batch = self._sampling_batch(requests, appendable)
        if len(parts) == 1:
            logits = parts[0][1].float()
        else:
            row = {id(r): i for i, r in enumerate(requests)}
            logits = torch.empty(len(requests), self.vocab_size, dtype=torch.float32, device=self.device)
            for rs, part in parts:
                if rs:
                    logits[to_device([row[id(r)] for r in rs], self.device)] = part.float()
        return self._sample(logits, requests, batch)

    def can_run_ahead(self, requests, sampled: SamplerOutput, max_blocks: int) -> bool:
        """Whether the decode step of `requests` one token further can be queued before the host reads `sampled`
        (their tokens of the step just run, in this order), their block tables then `max_blocks` wide at most:
        one GPU's graph for that batch and width already captured, the sampling batch that produced `sampled` to
        advance on the device, no grammar to consult."""
        last, graphs = self._last_batch, self.graphs
        return (graphs is not None and graphs.announce is None
                and last is not None and last[3] is sampled.token_ids and last[0] == [id(r) for r in requests]
                and all(r.constraint is None for r in requests)
                and graphs.captured(len(requests), max_blocks))

    @torch.inference_mode()
    def run_ahead(self, requests, sampled: SamplerOutput) -> SamplerOutput:
        """The decode step of `requests` fed the tokens in `sampled` straight from the device (can_run_ahead
        said yes; each request's num_computed is the position of its token in `sampled`, its blocks hold it)."""
        batch = self._sampling_batch(requests, appendable=True)
        logits = self._replay(requests, sampled.token_ids)
        return self._sample(logits.float(), requests, batch)

    def _replay(self, requests, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One token per request through the decode graph → logits [len(requests), V]; the tokens at their
        num_computed, or `input_ids` on the device (a step ahead)."""
        if input_ids is None:
            input_ids = [r.tokens(r.num_computed, r.num_computed + 1)[0] for r in requests]
        return self.graphs.run(input_ids, [r.num_computed for r in requests], [r.slot for r in requests],
                               [r.blocks for r in requests])

    def _graph_chunks(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The chunks the decode graph can run: one token each (a decode, or a prompt token fed alone), all of
        them in one bucket; those that sample first."""
        if self.graphs is None:
            return []
        # not a sequence's first token: the decode step continues a slot's states (on several GPUs the workers
        # clear a slot only for an eager chunk that starts a sequence)
        decoding = [c for c in chunks if c.num_tokens == 1 and c.request.num_computed > 0]
        decoding.sort(key=lambda c: not c.samples)   # rows that sample first: their logits are a slice
        if decoding and self.graphs.can_run(len(decoding), max(len(c.request.blocks) for c in decoding)):
            return decoding
        return []

    def _forward_eager(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """The torch forward of any chunks → logits of those that sample ([n, V], model dtype), or None."""
        segments, ids, start = [], [], 0
        for chunk in chunks:
            r = chunk.request
            ids.extend(r.tokens(r.num_computed, r.num_computed + chunk.num_tokens))
            blocks = to_device(r.blocks, self.device)
            segments.append(Segment(r.slot, blocks, start, chunk.num_tokens, r.num_computed))
            start += chunk.num_tokens
        last_rows = [s.end - 1 for c, s in zip(chunks, segments) if c.samples]
        # (the step's chained and decode replays are queued before: none of its copies waits for them)
        input_ids = to_device(ids, self.device)
        last = to_device(last_rows, self.device)
        single = segments[0].slot if len(segments) == 1 else None
        plan = self.row_graphs.plan(len(ids), single) if self.row_graphs is not None else None
        hidden = self.model(input_ids, ForwardContext(segments, self.kv, self.states, pieces=plan))
        if plan is not None:
            plan.end()
        return self.model.compute_logits(hidden[last]) if last_rows else None

    def _appendable(self, requests) -> bool:
        """Whether the last step's batch serves these requests one token further (SamplingBatch.append)."""
        last = self._last_batch
        return (last is not None and last[3] is not None and last[0] == [id(r) for r in requests]
                and all(len(r.output_ids) == m + 1 for r, m in zip(requests, last[1])))

    def _sampling_batch(self, requests, appendable: bool) -> SamplingBatch:
        """The last batch advanced by its tokens when `appendable` (see _appendable), else a new one."""
        ids, last = [id(r) for r in requests], self._last_batch
        if appendable:   # a step ahead records the lengths its tokens will give (_appendable's m + 1)
            batch = last[2]
            batch.append(last[3])
            self._last_batch = (ids, [m + 1 for m in last[1]], batch, last[3])
            return batch
        lengths = [len(r.output_ids) for r in requests]
        batch = SamplingBatch.build([r.params for r in requests], [r.output_ids for r in requests],
                                    [r.prompt_ids for r in requests], self.vocab_size, self.device,
                                    eos_token_ids=self.eos_token_ids, generators=[r.generator for r in requests])
        for r, g in zip(requests, batch.generators):
            r.generator = g
        self._last_batch = (ids, lengths, batch, None)
        return batch

    def _sample(self, logits: torch.Tensor, requests, batch: SamplingBatch) -> SamplerOutput:
        apply_constraints(logits, [r.constraint for r in requests])
        out = sample(logits, batch, generator=self.generator)
        if self._last_batch is not None and self._last_batch[2] is batch:
            self._last_batch = (*self._last_batch[:3], out.token_ids)
        return out
