"""An expert cache's pools adapted between decode steps that run inside CUDA graphs.

In a captured decode step the MoE kernels read through each layer's slot table, a missing expert straight from its
row of the host store (ops.moe_int4.CachedExperts): nothing decided on the host can happen inside the step. So
each layer's decode writes its routed ids into its row of one device buffer, and after each decode step the engine
calls `after_step` (LLMEngine), which
 1. publishes the copies that have finished: their experts enter the device slot tables;
 2. learns from the routing of the last step whose ids have reached page-locked memory (copied behind the step;
    never waited for; LAYERS_PER_STEP layers a call): it counts hits and misses, tells each layer's policy, and
    gives up to COPIES_PER_LAYER of each layer's missed experts a slot — a free one, else the least valuable
    resident's when the policy values the missed expert more (it can be read from host memory meanwhile);
 3. takes a victim out of the table on the compute stream first and overwrites its slot on the copy stream only
    after an event recorded there, so the steps queued before (decode ahead keeps up to two) still read the old
    expert; the new one enters the table once its copy's event has passed (step 1 of a later call).
The eager path (prefill: LayerExpertCache.load) settles first: it waits for the pending copies and publishes them.
On a CPU there is no graph and no stream: the same bookkeeping runs with plain copies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Experts copied in per layer and step at most: the copies share PCIe with the kernels' reads of missing experts.
COPIES_PER_LAYER = 2
# Layers learned from per call: a layer's bookkeeping is ~60 small CPU tensor ops, 0.8-0.9 ms of host time on the
# 2-core dev machine (Flash-Next's shapes: 512 experts, top-10, 196 slots, lfu-decay), so an observation of its 48
# layers is spread over 12 steps (~3.5 ms a step there) instead of stalling one: decode ahead hides host time only
# up to a step's GPU time. The next observation is taken once the last is learned. Vectorising the learning over
# all layers at once is the way to learn from every step.
LAYERS_PER_STEP = 4


@dataclass
class PendingCopy:
    layer: object            # LayerExpertCache
    experts: list[int]
    slots: list[int]
    done: torch.cuda.Event | None


class GraphPool:
    def __init__(self, layers: list, max_rows: int, top_k: int, device: torch.device):
        self.layers, self.top_k, self.device = layers, top_k, device
        self.gpu = device.type == "cuda"
        self.observed = torch.full((len(layers), max_rows * top_k), -1, dtype=torch.long, device=device)
        self.observed_host = torch.empty(self.observed.shape, dtype=torch.long, pin_memory=self.gpu)
        self.reading: tuple[torch.cuda.Event | None, int] | None = None   # (copy done, rows) of observed_host
        self.learning: tuple[torch.Tensor, int] | None = None    # (the observation read, next layer to learn)
        self.pending: list[PendingCopy] = []
        for i, layer in enumerate(layers):
            layer.graph_pool, layer.observed = self, self.observed[i]

    def after_step(self, rows: int | None) -> None:
        """After a decode step of `rows` rows (None: no decode graph ran since the last call)."""
        self._publish(wait=False)
        if self.reading is not None:
            done, read_rows = self.reading
            if done is None or done.query():
                self.reading = None
                self.learning = (self.observed_host[:, :read_rows * self.top_k], 0)
        if self.learning is not None:
            observed, first = self.learning
            last = min(first + LAYERS_PER_STEP, len(self.layers))
            self._learn(self.layers[first:last], observed[first:last])
            self.learning = (observed, last) if last < len(self.layers) else None
        if rows and self.reading is None and self.learning is None:   # one observation at a time
            self.observed_host.copy_(self.observed, non_blocking=self.gpu)
            done = None
            if self.gpu:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
            self.reading = (done, rows)

    def settle(self) -> None:
        """Wait for the pending copies and publish them (before the eager path touches the pools)."""
        self._publish(wait=True)

    def _publish(self, wait: bool) -> None:
        still = []
        for copy in self.pending:
            if copy.done is not None and not wait and not copy.done.query():
                still.append(copy)
                continue
            if copy.done is not None:
                copy.done.synchronize()
            layer = copy.layer
            layer.slot_of[copy.experts] = torch.tensor(copy.slots, dtype=torch.long)
            layer.slot_table.copy_(layer.slot_of, non_blocking=self.gpu)
        self.pending = still

    def _learn(self, layers: list, observed: torch.Tensor) -> None:
        copying = {(id(c.layer), e) for c in self.pending for e in c.experts}
        for layer, ids in zip(layers, observed):
            routed = ids[ids >= 0].unique()
            if not len(routed):
                continue
            layer.policy.access(routed)
            missing = routed[layer.slot_of[routed] < 0]
            layer.stats.hits += len(routed) - len(missing)
            layer.stats.misses += len(missing)
            wanted = [e for e in missing.tolist() if (id(layer), e) not in copying][:COPIES_PER_LAYER]
            if wanted:
                self._copy_in(layer, wanted)

    def _admitted(self, layer, experts: list[int]) -> tuple[list[int], list[int]]:
        """(the experts to copy in, the residents they evict): free slots first, then the least valuable residents,
        each only for an expert the policy values more (the most valuable experts against the least valuable
        residents, in order) — a missed expert can be read from host memory meanwhile, so a hot resident is not
        traded for a one-off."""
        policy = layer.policy
        wanted = torch.tensor(experts, dtype=torch.long)
        wanted = wanted[torch.argsort(policy.value(wanted), descending=True, stable=True)].tolist()
        admitted = wanted[:len(layer.free)]
        rest = wanted[len(admitted):]
        if not rest:
            return admitted, []
        victims = policy.victims(layer.slot_of >= 0, len(rest))
        worth = policy.value(torch.tensor(rest[:len(victims)], dtype=torch.long))
        kept = policy.value(torch.tensor(victims, dtype=torch.long))
        trades = int((worth > kept).long().cumprod(0).sum()) if victims else 0   # in order, until one is not worth it
        return admitted + rest[:trades], victims[:trades]

    def _copy_in(self, layer, experts: list[int]) -> None:
        experts, victims = self._admitted(layer, experts)
        if not experts:
            return
        if victims:
            layer.free += layer.slot_of[victims].tolist()
            layer.slot_of[victims] = -1
            layer.slot_table.copy_(layer.slot_of, non_blocking=self.gpu)   # the victims leave the table first
        slots = [layer.free.pop() for _ in experts]
        rows = torch.tensor(experts, dtype=torch.long)
        done = None
        if self.gpu:
            freed = torch.cuda.Event()
            freed.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(layer.copy_stream):
                layer.copy_stream.wait_event(freed)   # steps queued before still read the victims' slots
                layer.copy_rows(rows, slots)
                done = torch.cuda.Event()
                done.record(layer.copy_stream)
        else:
            layer.copy_rows(rows, slots)
        layer.stats.bytes_copied += len(experts) * layer.bytes_per_expert
        self.pending.append(PendingCopy(layer, experts, slots, done))
