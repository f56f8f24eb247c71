"""An expert cache's pools adapted between decode steps that run inside CUDA graphs.

In a captured decode step the MoE kernels read through each layer's slot table, a missing expert straight from its
row of the host store (ops.moe_int4.CachedExperts): nothing decided on the host can happen inside the step. So
each layer's decode writes its routed ids into its row of one device buffer, and after each decode step the engine
calls `after_step` (LLMEngine), which
 1. publishes the copies that have finished: their experts enter the device slot tables;
 2. learns from the routing of the steps whose ids have reached page-locked memory (copied behind the step,
    never waited for; OBSERVATIONS_IN_FLIGHT copies at once, a step finding them all in flight goes unobserved),
    all layers at once in [layers, experts] tensor ops: counts hits and misses, updates each expert's value
    (--expert-cache-policy: a count decayed per learned step, or the step last seen), and gives up to
    COPIES_PER_LAYER of each layer's most valuable missed experts a slot — a free one, else the least valuable
    resident's when the missed expert is worth more (it can be read from host memory meanwhile);
 3. takes a victim out of the table on the compute stream first and overwrites its slot on the copy stream only
    after an event recorded there, so the steps queued before (decode ahead keeps up to two) still read the old
    expert; the new one enters the table once its copy's event has passed (step 1 of a later call).
The eager path (prefill: LayerExpertCache.load) settles first: it waits for the pending copies and publishes them.
On a CPU there is no graph and no stream: the same bookkeeping runs with plain copies.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flashnext.cache.expert_cache import attach_keeper, copy_expert_rows
from flashnext.ops.row_copy import table_row_copy
from flashnext.weights.pinned import upload

# Experts copied in per layer and per learning step at most (the copies share PCIe with the kernels' reads of
# missing experts), MAX_COPIES_PER_STEP in all, the layers taking turns.
# FLASHNEXT_EXPERT_COPIES_PER_LAYER / FLASHNEXT_EXPERT_COPIES_PER_STEP (docs/expert_cache.md) for measuring. At 2 and
# 16 Flash-Next's pools (24 GiB, calibrated trace) hit 53% on the H200, far below LRU's 87% in replay: 16 copies a
# token (the cap) against ~220 misses; at 10 and 480 (a layer's top-k, no cap for 48 layers) 83%, 44.6 → 70 tok/s.
COPIES_PER_LAYER = max(1, int(os.environ.get("FLASHNEXT_EXPERT_COPIES_PER_LAYER", "10")))
MAX_COPIES_PER_STEP = max(1, int(os.environ.get("FLASHNEXT_EXPERT_COPIES_PER_STEP", "480")))
# Observations (a step's routed ids on their way to page-locked memory) in flight at once: with one, the pools
# learned from about every other step on the H200 once the decode inputs came from page-locked memory (session 11:
# 244–333 expert reads counted a token of Flash-Next's 480, hit rate 83% → 72%; the host runs two steps ahead now).
# With three, session 12 counted 82% / 73% again.
OBSERVATIONS_IN_FLIGHT = max(1, int(os.environ.get("FLASHNEXT_EXPERT_OBSERVATIONS", "3")))
# A learning step is ~30 tensor ops over [layers, experts] plus the copies it starts: 1.6 ms of host time for all 48
# layers of Flash-Next's shapes (512 experts, top-10, 196 slots) with 16 copies on the 2-core dev machine (copies
# not issued there; measured at the old 2 / 16 limits, not at 10 / 480); done per layer it had been 0.8-0.9 ms a
# layer. The copies themselves are one kernel (ops/row_copy.py): as a torch copy per (expert, tensor) they took
# 20.9 ms of host time a token on the H200 (810 copies a token, random routing, 24 GiB; session 12).


@dataclass
class PendingCopy:
    """The copies one learning step started (all layers): they enter the tables together once `done` has passed."""
    layers: torch.Tensor     # [n] layer index of each copied expert
    experts: torch.Tensor    # [n]
    slots: torch.Tensor      # [n]
    done: torch.cuda.Event | None


class GraphPool:
    def __init__(self, layers: list, max_rows: int, top_k: int):
        self.layers, self.top_k, self.device = layers, top_k, layers[0].device
        self.gpu = self.device.type == "cuda"
        self.observed = torch.full((len(layers), max_rows * top_k), -1, dtype=torch.long, device=self.device)
        self.observed_host = torch.empty((OBSERVATIONS_IN_FLIGHT, *self.observed.shape), dtype=torch.long,
                                         pin_memory=self.gpu)
        # the observations in flight, oldest first: (copy done, rows, which of observed_host); they finish in order,
        # so the buffers are taken in turn
        self.reading: list[tuple[torch.cuda.Event | None, int, int]] = []
        self.next_buffer = 0
        self.pending: list[PendingCopy] = []
        # every layer's slot_of (and device table: attach_keeper) becomes a row of one [layers, experts] tensor, so
        # learning is a few whole-tensor ops and the tables take one host-to-device copy
        self.slot_of = torch.stack([layer.slot_of for layer in layers])
        for i, layer in enumerate(layers):
            layer.slot_of = self.slot_of[i]
        self.tables, self.live_rows = attach_keeper(self, layers, max_rows)
        self.last_upload: torch.cuda.Event | None = None   # the end of the last table upload (a prefetch waits)
        self.tables_stale = False   # slot_of changed since the last upload (published copies): one upload a step
        self.copying = torch.zeros(self.slot_of.shape, dtype=torch.bool)   # experts whose copy is under way
        policy = layers[0].policy
        self.decay = getattr(policy, "decay", None)     # lfu-decay: counts decayed per learned step; lru: None
        self.value = torch.zeros(self.slot_of.shape, dtype=torch.float64)
        self.clock = 0
        # every layer's store rows → pool slots, for all tensors of an expert (table i·len(names) + j: layer i's
        # tensor j): one kernel a learning step on the GPU, where a torch copy a row cost ~25 µs of host time each
        self.names = layers[0].names
        assert all(layer.names == self.names for layer in layers)
        self._copy_tables = table_row_copy([t for layer in layers for t in layer.sources],
                                           [t for layer in layers for t in layer.destinations])

    def routed(self, layer, ids: torch.Tensor) -> None:
        """A layer's decode, before its MoE kernels: its routed ids into the step's observation."""
        self.observed[layer.pool_index, :ids.numel()].copy_(ids.reshape(-1))

    def before_step(self, rows: int) -> None:
        """Before a decode step of `rows` real rows is queued (DecodeGraphs.keeper)."""
        self.live_rows.fill_(rows)

    def after_step(self, rows: int) -> None:
        """After a decode step of `rows` rows (DecodeGraphs.keeper)."""
        self._publish(wait=False)
        while self.reading and (self.reading[0][0] is None or self.reading[0][0].query()):
            _, read_rows, buffer = self.reading.pop(0)
            self._learn(self.observed_host[buffer, :, :read_rows * self.top_k])
        if len(self.reading) < OBSERVATIONS_IN_FLIGHT:
            buffer, self.next_buffer = self.next_buffer, (self.next_buffer + 1) % OBSERVATIONS_IN_FLIGHT
            # the whole buffer (~30 KB for Flash-Next): a column slice is not contiguous, and torch would copy it
            # through a pageable temporary, waiting for the steps queued before
            self.observed_host[buffer].copy_(self.observed, non_blocking=self.gpu)
            done = None
            if self.gpu:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
            self.reading.append((done, rows, buffer))
        if self.tables_stale:
            self._upload_tables()

    def settle(self) -> None:
        """Wait for the pending copies and publish them (before the eager path touches the pools)."""
        self._publish(wait=True)
        if self.tables_stale:
            self._upload_tables()

    def _publish(self, wait: bool) -> None:
        still = []
        for copy in self.pending:
            if copy.done is not None and not wait and not copy.done.query():
                still.append(copy)
                continue
            if copy.done is not None:
                copy.done.synchronize()
            self.slot_of[copy.layers, copy.experts] = copy.slots
            self.copying[copy.layers, copy.experts] = False
        self.tables_stale |= len(still) < len(self.pending)
        self.pending = still

    def _upload_tables(self) -> None:
        """The device tables become slot_of, in stream order after the steps queued so far, without a host wait."""
        self.tables_stale = False
        upload(self.tables, self.slot_of)
        if not self.gpu:
            return
        self.last_upload = torch.cuda.Event()
        self.last_upload.record(torch.cuda.current_stream(self.device))

    def _learn(self, observed: torch.Tensor) -> None:
        """observed [layers, rows·k] (-1: no row) → counters, values, and the copies worth starting."""
        layers, experts = self.slot_of.shape
        present = torch.zeros(layers, experts + 1, dtype=torch.bool)
        present.scatter_(1, torch.where(observed >= 0, observed, experts), True)
        present = present[:, :experts]
        self.clock += 1
        if self.decay is None:
            self.value[present] = float(self.clock)
        else:
            self.value.mul_(self.decay).add_(present)
        resident = self.slot_of >= 0
        missed = present & ~resident
        stats = self.layers[0].stats
        stats.hits += int((present & resident).sum())
        stats.misses += int(missed.sum())
        experts, victims = self.admitted(missed & ~self.copying, resident)
        self._copy_in(experts, victims)

    def admitted(self, candidates: torch.Tensor, resident: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
        """Per layer, (the experts to copy in, the residents they evict; -1 pads): up to COPIES_PER_LAYER of the
        most valuable candidates, into free slots first, then each over the least valuable resident left while it
        is worth more — in order, stopping at the first that is not (a hot resident is not traded for a one-off)."""
        n = min(COPIES_PER_LAYER, MAX_COPIES_PER_STEP, candidates.shape[1])
        worth, wanted = self.value.masked_fill(~candidates, -float("inf")).topk(n, dim=1)
        kept, victims = self.value.masked_fill(~resident, float("inf")).topk(n, dim=1, largest=False)
        free = torch.tensor([len(layer.free) for layer in self.layers])
        rank = torch.arange(n)[None, :] - free[:, None]        # ≥ 0: the victim this expert needs
        against = kept.gather(1, rank.clamp(0, n - 1))
        ok = (worth > -float("inf")) & ((rank < 0) | (worth > against))
        ok = ok.long().cumprod(1).bool()
        trades = (ok & (rank >= 0)).sum(1, keepdim=True)
        evicted = torch.where(torch.arange(n)[None, :] < trades, victims, -1)
        return torch.where(ok, wanted, -1).tolist(), evicted.tolist()

    def _copy_in(self, experts: list[list[int]], victims: list[list[int]]) -> None:
        """Start the copies `admitted` chose (per layer, -1 padded), at most MAX_COPIES_PER_STEP: the victims leave
        the tables, one event behind the queued steps, the copies on the copy stream, one event at their end."""
        start = self.clock % len(experts)   # the layers take turns at the head of the queue
        plan = [(i, [e for e in experts[i] if e >= 0], [v for v in victims[i] if v >= 0])
                for i in (*range(start, len(experts)), *range(start))
                if experts[i][0] >= 0][:max(1, MAX_COPIES_PER_STEP // len(experts[0]))]
        if not plan:
            return
        gone = [(i, v) for i, _, vs in plan for v in vs]
        if gone:
            rows, cols = torch.tensor(gone).T
            freed_slots = self.slot_of[rows, cols].tolist()
            for (i, _), slot in zip(gone, freed_slots):
                self.layers[i].free.append(slot)
            self.slot_of[rows, cols] = -1
            self._upload_tables()   # the victims leave the tables first (with the copies published this step)
        copies = [(i, e, self.layers[i].free.pop()) for i, es, _ in plan for e in es]
        layers, experts_, slots = torch.tensor(copies, dtype=torch.long).T
        done = None
        if self.gpu:
            freed = torch.cuda.Event()
            freed.record(torch.cuda.current_stream(self.device))
            stream = self.layers[0].copy_stream
            with torch.cuda.stream(stream):
                stream.wait_event(freed)   # the steps queued before still read the victims' slots
                self._copy_rows(layers, experts_, slots)
                done = torch.cuda.Event()
                done.record(stream)
        else:
            self._copy_rows(layers, experts_, slots)
        self.copying[layers, experts_] = True
        stats = self.layers[0].stats
        stats.bytes_copied += sum(self.layers[i].bytes_per_expert for i, _, _ in copies)
        self.pending.append(PendingCopy(layers, experts_, slots, done))

    def _copy_rows(self, layers: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor) -> None:
        """Every tensor of each (layer, expert) → its slot, on the current stream."""
        copy_expert_rows(self._copy_tables, len(self.names), layers, experts, slots)
