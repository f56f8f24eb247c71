"""An expert cache's pools adapted inside the captured decode step: how CUDA-graph decode steps admit experts.

Each layer's decode first runs ops/expert_claims.py on its routed ids: the residents routed become the most recently
used, and each missing expert takes the slot of the least recently used resident not routed in this step; the MoE
decode kernels then read it from host memory and write it into that slot as they read it. So an admitted expert
crosses PCIe once, in the step that missed it. (Pools that learned from the routed ids between steps and copied
the admitted experts in afterwards read each twice: on the H200, bench experts, Flash-Next INT4, 24 GiB, calibrated
trace, they decoded 67.9 / 66.3 tok/s at 81.8% / 73.3% hits against this pool's 105.5 / 105.1 at 85.3% / 76.4%,
repeated / varied prompts; session 13, which removed them.) The policy is LRU (the calibrated trace's replay: LRU
86.9% at 211 slots a layer, as lfu-decay), every miss admitted while a resident not routed now is left.

All of it is on the device: the host only reads the counters (copied behind the steps, never waited for) and, before
the eager path (prefill) touches the pools, settles: it waits for the queued steps and takes the tables back.
The pools start full (free slots filled with experts not resident): an admission only ever takes a resident's slot.
"""
from __future__ import annotations

import torch

from flashnext.ops.expert_claims import claim_slots
from flashnext.ops.moe_int4 import CachedExperts
from flashnext.weights.pinned import upload


# The most rows of a captured decode step with an expert cache (LLMEngine's graph batches): the in-step admission was
# measured at up to 8, and the decode kernels read a missing expert from host memory once per token that chose it.
# (The eager path takes the decode kernels up to ops.moe_int4.decode_max_m(), as all-resident does: the same bits.)
CACHED_MAX_M = 8


class ClaimPool:
    """The keeper of captured decode steps (DecodeGraphs.keeper) for all layers' pools (cache/expert_cache.py's
    LayerExpertCache: `layers`): decode steps of up to CACHED_MAX_M rows."""

    def __init__(self, layers: list):
        self.layers, self.device = layers, layers[0].device
        self.gpu = self.device.type == "cuda"
        self.last_upload: torch.cuda.Event | None = None   # the end of settle's table upload (a prefetch waits)
        num_experts = layers[0].num_experts
        self.last_used = torch.zeros(len(layers), num_experts, dtype=torch.long, device=self.device)
        self.clock = torch.zeros(len(layers), 1, dtype=torch.long, device=self.device)
        self.counts = torch.zeros(len(layers), 3, dtype=torch.long, device=self.device)   # hits, misses, admitted
        self.counted = torch.zeros(3, dtype=torch.long)    # what the stats have of them
        self.counts_host = torch.zeros(3, dtype=torch.long, pin_memory=self.gpu)
        self.reading: torch.cuda.Event | None = None      # a copy of the counts on its way to counts_host
        self.steps = 0
        self.unsettled = False         # decode steps claimed slots since the last settle
        # every layer's device table a row of one [layers, experts] tensor (settle: one copy each way); the step's
        # real rows (the kernels skip a bucket's padding rows past them: every row, as many as a captured step has,
        # until before_step says otherwise — the warm-ups of a capture run without it)
        self.tables = torch.stack([layer.slot_table for layer in layers])
        self.live_rows = torch.full((1,), CACHED_MAX_M, dtype=torch.int32, device=self.device)
        for i, layer in enumerate(layers):   # each layer's view for graph steps
            layer.slot_table = self.tables[i]
            layer.claim_pool, layer.pool_index = self, i
            layer.cached = CachedExperts(layer.slot_table, layer.host_weight("gate_up"), layer.host_weight("down"),
                                         self.live_rows, admits=True)
        for layer in layers:           # free slots filled with the first experts not resident (eager copies, once)
            if layer.free:
                absent = (layer.slot_of < 0).nonzero().flatten()[:len(layer.free)]
                layer._copy_rows(absent, layer._claim(absent, pinned=absent))
                layer._upload_table()

    def routed(self, layer, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """A layer's decode, before its MoE kernels: the routed ids claim their slots (a choice of weight 0, which the
        kernels skip, claims none)."""
        i = layer.pool_index
        self.unsettled = True   # claims queued outside a step too: the captures of warm-up (capture_widths)
        claim_slots(layer.slot_table, self.last_used[i], self.clock[i], self.counts[i], ids, self.live_rows, weights)

    def before_step(self, rows: int) -> None:
        """Before a decode step of `rows` real rows is queued (DecodeGraphs.keeper): a replayed step claims slots
        without running `routed`."""
        self.unsettled = True
        self.live_rows.fill_(rows)

    def after_step(self) -> None:
        """After a decode step (DecodeGraphs.keeper): the counters, read behind the steps now and then."""
        self.steps += 1
        if self.reading is not None and self.reading.query():
            self._count(self.counts_host)
            self.reading = None
        if self.reading is None and self.steps % 16 == 0:
            self.counts_host.copy_(self.counts.sum(0), non_blocking=self.gpu)
            if self.gpu:
                self.reading = torch.cuda.Event()
                self.reading.record(torch.cuda.current_stream(self.device))
            else:
                self._count(self.counts_host)

    def _count(self, totals: torch.Tensor) -> None:
        hits, misses, admitted = (totals - self.counted).tolist()
        self.counted = totals.clone()
        stats = self.layers[0].stats
        stats.hits += hits
        stats.misses += misses
        stats.admitted += admitted

    def settle(self) -> None:
        """Before the eager path touches the pools: the queued steps done, their admissions resident, the tables
        and free lists on the host as the device has them, the counters taken."""
        if not self.unsettled:
            return
        self.unsettled = False
        self.reading = None
        self._count(self.counts.sum(0).cpu())   # a copy to pageable memory: waits for the steps queued on the stream
        tables = self.tables.cpu()
        tables = torch.where(tables <= -2, -tables - 2, tables)     # their steps have run: the slots hold them
        for layer, table in zip(self.layers, tables):
            layer.slot_of.copy_(table)
            assert not layer.free   # full from the start; an admission or an eager load only trades a slot
        upload(self.tables, tables)
        if not self.gpu:
            return
        self.last_upload = torch.cuda.Event()
        self.last_upload.record(torch.cuda.current_stream(self.device))
