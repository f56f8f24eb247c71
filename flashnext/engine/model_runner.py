"""Runs one scheduled step through the model and samples the requests whose chunk reached their end.

This is the one place that turns scheduler output into tensors. A step of one token per request replays a
captured CUDA graph when `graphs` is given (engine/cuda_graph.py); any other step runs the eager torch path.
"""
from __future__ import annotations

import torch

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.state_pool import StatePool
from flashnext.engine.cuda_graph import DecodeGraphs
from flashnext.engine.sampler import SamplerOutput, SamplingBatch, sample
from flashnext.engine.scheduler import ScheduledChunk
from flashnext.engine.structured.backend import apply_constraints
from flashnext.models.context import ForwardContext, Segment


class ModelRunner:
    def __init__(self, model, kv: KVPool, states: StatePool, eos_token_ids, device, seed: int = 0,
                 graphs: DecodeGraphs | None = None):
        self.model = model
        self.graphs = graphs
        self.kv = kv
        self.states = states
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = torch.device(device)
        self.vocab_size = model.cfg.vocab_size
        # Requests without a seed share this generator: a server started with the same --seed replays.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> SamplerOutput | None:
        # The sampling tensors are built before the forward is queued: their small host→device copies then find
        # the GPU idle instead of waiting behind the step (a pageable copy blocks the host until it is done).
        requests = [c.request for c in chunks if c.samples]
        batch = self._sampling_batch(requests) if requests else None
        if self._graph_step(chunks):
            logits = self.graphs.run([r.all_ids[r.num_computed] for r in requests], [r.num_computed for r in requests],
                                     [r.slot for r in requests], [r.blocks for r in requests])
            return self._sample(logits.float(), requests, batch)
        segments, ids, start = [], [], 0
        for chunk in chunks:
            r = chunk.request
            ids.extend(r.all_ids[r.num_computed: r.num_computed + chunk.num_tokens])
            blocks = torch.tensor(r.blocks, dtype=torch.long, device=self.device)
            segments.append(Segment(r.slot, blocks, start, chunk.num_tokens, r.num_computed))
            start += chunk.num_tokens
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, ForwardContext(segments, self.kv, self.states))
        sampling = [(c, s) for c, s in zip(chunks, segments) if c.samples]
        if not sampling:
            return None
        last_rows = torch.tensor([s.end - 1 for _, s in sampling], device=self.device)
        logits = self.model.compute_logits(hidden[last_rows]).float()
        return self._sample(logits, requests, batch)

    def _graph_step(self, chunks: list[ScheduledChunk]) -> bool:
        return (self.graphs is not None and all(c.num_tokens == 1 and c.samples for c in chunks)
                and self.graphs.can_run(len(chunks), max(len(c.request.blocks) for c in chunks)))

    def _sampling_batch(self, requests) -> SamplingBatch:
        batch = SamplingBatch.build([r.params for r in requests], [r.output_ids for r in requests],
                                    [r.prompt_ids for r in requests], self.vocab_size, self.device,
                                    eos_token_ids=self.eos_token_ids, generators=[r.generator for r in requests])
        for r, g in zip(requests, batch.generators):
            r.generator = g
        return batch

    def _sample(self, logits: torch.Tensor, requests, batch: SamplingBatch) -> SamplerOutput:
        apply_constraints(logits, [r.constraint for r in requests])
        return sample(logits, batch, generator=self.generator)
