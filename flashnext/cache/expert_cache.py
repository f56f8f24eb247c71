"""Routed experts kept in host memory with a pool of device slots per layer (`--expert-vram-gb`).

Each `Int4Experts` of the model keeps its stacked INT4 tensors (docs/int4.md's kernel layout) in a host store
— pinned and mapped when CUDA is present, so kernels can read it over PCIe — and its buffers become a device
pool of S expert slots in the same layout. A forward maps the routed expert ids to slots through a slot table;
the experts missing from the pool are copied in first (as many as the pool holds): on the GPU one copy kernel
per layer (ops/row_copy.py) queued on the compute stream, on the CPU a torch copy a row. The experts a step
needs are pinned while it runs; the rest are evicted by the policy (flashnext/cache/expert_policy.py).

Prefetch (`--expert-prefetch`, on by default): while layer L's MoE runs, the next cached layer's router is
applied to L's MoE input — the next layer's input is that plus two residual updates, so its top-k is a good
guess — and the guessed experts that are not resident are copied into the next pool on the copy stream
without waiting (an event the next layer's compute waits on). The guess rides
on the host sync the layer takes anyway. Only for decode-sized batches (at most half a pool of guesses), so a
prefill never thrashes the next pool. Outputs do not depend on it: an expert is resident or copied before use.

A step that routes to more distinct experts than S runs in rounds of at most S experts, in expert order, on the
CPU and through the GPU's grouped kernels (more than 8 rows): on the CPU every round sums each expert's output into
one fp32 accumulator in the same order as `moe_int4_reference`; on the GPU each round keeps the grouped kernels'
per-(token, choice) terms, summed once at the end. A decode-sized batch on the GPU needs no rounds: the first S
experts are loaded and the decode kernels read the others from the host store (CachedExperts). Either way the
result is all-resident's bit for bit, at any budget (on the GPU: all-resident with the grouped Triton kernels,
FLASHNEXT_MOE_PREFILL=triton; by default an all-resident prefill from 4 rows an expert takes the transposed-tile
kernels or dequantised experts, ops.moe_int4.prefill_path, which a cache never does).
Counting: one read per (layer, forward, distinct routed expert): hits + misses = reads.

That is the eager path (prefill; decode without CUDA graphs). A captured decode step reads through the slot table
instead, missing experts straight from the host store, and the pools adapt inside the step
(cache/expert_claim_pool.py): `decode`, ExpertCache.enable_graphs.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashnext.cache.expert_claim_pool import ClaimPool
from flashnext.cache.expert_policy import make_policy
from flashnext.ops import moe_int4 as moe_ops
from flashnext.ops.row_copy import table_row_copy
from flashnext.weights.int4_layout import Int4Weight, dequantize
from flashnext.weights.pinned import host_empty, pin_in_place, upload

log = logging.getLogger("flashnext.expert_cache")


@dataclass
class ExpertCacheStats:
    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0
    prefetched: int = 0          # experts copied ahead of their layer (counted in bytes_copied too)
    prefetch_used: int = 0       # of which the layer then read (hits thanks to the prefetch)
    admitted: int = 0            # misses admitted inside a captured decode step (written as read: no copy)

    def __post_init__(self):
        # the copies' time counted so far (stall_seconds), the (start, end) events around copies queued on a GPU's
        # compute stream not counted yet, and the lock the engine thread (adding) and /metrics (reading) share
        self._stalled = 0.0
        self._timed: collections.deque = collections.deque()
        self._lock = threading.Lock()

    @property
    def stall_seconds(self) -> float:
        """Time the forward waited for misses to be copied in: on a GPU the copy kernels' time on the compute
        stream (what the layer's kernels queued after them waited), on a CPU the copies' wall time."""
        with self._lock:
            self._count_finished()
            return self._stalled

    def add_stall(self, seconds: float) -> None:
        with self._lock:
            self._stalled += seconds

    def add_stall_events(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """Copies between `start` and `end` on the stream: counted once they have run (only those in flight wait)."""
        with self._lock:
            self._count_finished()
            self._timed.append((start, end))

    def _count_finished(self) -> None:
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.popleft()
            self._stalled += start.elapsed_time(end) / 1e3

    @property
    def hit_rate(self) -> float:
        reads = self.hits + self.misses
        return self.hits / reads if reads else 0.0


def _one(w: Int4Weight, slot: int) -> Int4Weight:
    pick = (lambda t: None if t is None else t[slot])
    return Int4Weight(w.qweight[slot], w.scales[slot], pick(w.zeros), pick(w.perm), w.group_size)


class LayerExpertCache:
    """The slot pool of one Int4Experts module; installs itself as `module.expert_cache`."""

    def __init__(self, module, num_slots: int, policy: str, stats: ExpertCacheStats, device: torch.device,
                 copy_stream=None):
        """`copy_stream`: on a GPU, the stream prefetches copy on (shared by all layers); None on a CPU."""
        self.module, self.num_slots, self.stats, self.device = module, num_slots, stats, device
        self.num_experts = module.num_experts
        self.policy = make_policy(policy, self.num_experts)
        self.copy_stream = copy_stream
        # prefetch: the next cached layer (its router module and cache), experts copied ahead and not yet read,
        # and the event that ends the last prefetch copy (the next forward's compute waits on it)
        self.next_router, self.next_cache = None, None
        self.prefetched: set[int] = set()
        self.prefetch_event = None
        pin = torch.cuda.is_available()
        self.names = [n for n, b in module.named_buffers(recurse=False) if b is not None]
        self.host = {}
        for name in self.names:
            full = getattr(module, name).detach()
            if full.device.type == "cpu":      # loaded into host memory already (load_model with an expert budget)
                host = pin_in_place(full.contiguous(), "the expert store") if pin else full
            else:
                host = host_empty(tuple(full.shape), full.dtype, pin, "the expert store")
                host.copy_(full)
            self.host[name] = host
            setattr(module, name, torch.zeros((num_slots, *full.shape[1:]), dtype=full.dtype, device=device))
            del full
        self.bytes_per_expert = sum(t[0].numel() * t.element_size() for t in self.host.values())
        # store rows → pool slots, every tensor of an expert: on the GPU one kernel a call reading the page-locked
        # store over PCIe (ops/row_copy.py) — no host gather into staging rows, no host wait. The copies hold the
        # pools' and the store's addresses: neither moves after this.
        self._copy_tables = table_row_copy([self.host[name] for name in self.names],
                                           [getattr(module, name) for name in self.names])
        self.slot_of = torch.full((self.num_experts,), -1, dtype=torch.long)        # expert → slot (host copy)
        self.slot_table = torch.full((self.num_experts,), -1, dtype=torch.long, device=device)
        self.free = list(range(num_slots))
        # Set by the ClaimPool of captured decode steps (ExpertCache.enable_graphs): the kernels read the pool
        # through the slot table and a missing expert from its host row (`cached`); the step's routed ids claim
        # their slots there (`routed`) under this layer's index.
        self.claim_pool, self.pool_index, self.cached = None, None, None
        module.expert_cache = self

    def host_weight(self, prefix: str) -> Int4Weight:
        """The host store's stacked Int4Weight of "gate_up" or "down"."""
        get = lambda name: self.host.get(f"{prefix}_{name}")  # noqa: E731
        return Int4Weight(get("qweight"), get("scales"), get("zeros"), get("perm"),
                          self.module.group_sizes[prefix == "down"])

    def decode(self, x, weights, ids, shared: moe_ops.SharedExpert | None = None):
        """The graph-safe forward of a decode step when the ClaimPool is installed (ExpertCache.enable_graphs):
        no host sync, no copy. Without one, and for batches the decode kernels do not take (above decode_max_m() rows;
        the engine captures none above expert_claim_pool.CACHED_MAX_M), `forward`."""
        if self.claim_pool is None or not moe_ops.runs_cached_experts(x):
            return self.forward(x, weights, ids, shared)
        self.claim_pool.routed(self, ids, weights)
        return moe_ops.moe_int4(x, ids, weights, self.module.weight_int4("gate_up"), self.module.weight_int4("down"),
                                shared=shared, cached=self.cached)

    def load(self, experts: list[int]) -> list[int]:
        """Make `experts` (distinct, ≤ num_slots) resident; → their slots. Only other experts are evicted."""
        # the prefetched rows and slot table land before this layer reads them (or settle uploads a table)
        if self.prefetch_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.prefetch_event)
        if self.claim_pool is not None:          # the queued decode steps' admissions resident first
            self.claim_pool.settle()
        need = torch.tensor(experts, dtype=torch.long)
        self.policy.access(need)
        missing = need[self.slot_of[need] < 0]
        self.stats.hits += len(need) - len(missing)
        self.stats.misses += len(missing)
        used = self.prefetched.intersection(experts)
        self.stats.prefetch_used += len(used)
        self.prefetched -= used
        if len(missing):
            slots = self._claim(missing, pinned=need)
            self._copy_in(missing, slots)
            self._upload_table()
        return self.slot_of[need].tolist()

    def prefetch(self, experts: list[int]) -> None:
        """Start copying the non-resident `experts` (a guess, at most half the pool) in; do not wait."""
        need = torch.tensor(experts, dtype=torch.long)
        missing = need[self.slot_of[need] < 0]
        if not len(missing):
            return
        slots = self._claim(missing, pinned=need)
        self.prefetched.update(missing.tolist())
        self.stats.prefetched += len(missing)
        self.stats.bytes_copied += len(missing) * self.bytes_per_expert
        if self.copy_stream is None:
            self._copy_rows(missing, slots)
            self._upload_table()
            return
        with torch.cuda.stream(self.copy_stream):
            if self.claim_pool is not None and self.claim_pool.last_upload is not None:
                self.copy_stream.wait_event(self.claim_pool.last_upload)   # an older table upload must land first
            self._copy_rows(missing, slots)
            self._upload_table()
            self.prefetch_event = torch.cuda.Event()
            self.prefetch_event.record(self.copy_stream)

    def _claim(self, missing: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
        """Slots for `missing` (free ones first, then the policy's victims among the unpinned residents)."""
        shortfall = len(missing) - len(self.free)
        if shortfall > 0:
            candidates = self.slot_of >= 0
            candidates[pinned] = False
            victims = self.policy.victims(candidates, shortfall)
            self.free += self.slot_of[victims].tolist()
            self.slot_of[victims] = -1
            self.prefetched.difference_update(victims)
        slots = torch.tensor([self.free.pop() for _ in range(len(missing))], dtype=torch.long)
        self.slot_of[missing] = slots
        return slots

    def _copy_rows(self, experts: torch.Tensor, slots: torch.Tensor) -> None:
        """Store rows `experts` → pool slots `slots`, every tensor of the layout, on the current stream."""
        names = len(self.names)
        self._copy_tables(torch.arange(names).repeat(len(experts)), experts.repeat_interleave(names),
                          slots.repeat_interleave(names))

    def _upload_table(self) -> None:
        """The device slot table becomes slot_of in stream order, without a host wait (from page-locked memory)."""
        upload(self.slot_table, self.slot_of)

    def _copy_in(self, experts: torch.Tensor, slots: torch.Tensor) -> None:
        """Misses in before the layer's kernels read them: on the GPU queued on the compute stream, so the kernels
        queued before (an earlier round of this layer) are done with the slots it overwrites and the ones after
        wait for it; its time there is the stall (ExpertCacheStats)."""
        if self.copy_stream is None:
            start = time.perf_counter()
            self._copy_rows(experts, slots)
            self.stats.add_stall(time.perf_counter() - start)
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._copy_rows(experts, slots)
            end.record()
            self.stats.add_stall_events(start, end)
        self.stats.bytes_copied += len(experts) * self.bytes_per_expert

    def _guess_next(self, x: torch.Tensor) -> torch.Tensor | None:
        """The next cached layer's likely experts for rows x (on x's device), or None: no next layer, or a batch
        whose guesses could fill more than half of its pool."""
        if (self.next_cache is None or self.next_router.trace is not None      # a routing trace ignores the router
                or x.shape[0] * self.next_router.top_k > self.next_cache.num_slots // 2):
            return None
        return F.linear(x, self.next_router.weight).topk(self.next_router.top_k, dim=-1).indices.unique()

    def _start_prefetch(self, guess: list[int]) -> None:
        if guess:
            self.next_cache.prefetch(guess)

    def forward(self, x, weights, ids, shared: moe_ops.SharedExpert | None = None):
        """Int4Experts.forward through the slot pool, with the all-resident result bit for bit: the same kernels
        over the same words, in the same order of additions. `shared` where moe_ops.runs_shared_expert(x)."""
        routed = ids.unique()
        guess = self._guess_next(x)
        both = (routed if guess is None else torch.cat([routed, guess])).tolist()   # the layer's one host sync
        experts, guess_ids = both[:routed.numel()], both[routed.numel():]
        rounds = [experts[i:i + self.num_slots] for i in range(0, len(experts), self.num_slots)]
        gate_up, down = self.module.weight_int4("gate_up"), self.module.weight_int4("down")
        if x.is_cuda and moe_ops._BACKEND != "reference":
            if moe_ops.runs_cached_experts(x):
                # the decode kernels: the first round resident, the experts beyond the pool read from host memory
                self.load(rounds[0])
                self.stats.misses += len(experts) - len(rounds[0])   # a second round: the first filled the pool
                cached = moe_ops.CachedExperts(self.slot_table, self.host_weight("gate_up"), self.host_weight("down"))
                out = moe_ops.moe_int4(x, ids, weights, gate_up, down, shared=shared, cached=cached)
            else:
                # the grouped kernels' per-(token, choice) terms, a round's experts at a time, summed once at the end
                assert shared is None, "the grouped kernels do not run a shared expert (moe_ops.runs_shared_expert)"
                terms = None
                for chunk in rounds:
                    slots = self.load(chunk)
                    mask = torch.isin(ids, torch.tensor(chunk, device=ids.device))
                    sid = torch.where(mask, self.slot_table[ids], slots[0])
                    part = moe_ops.routed_pairs(x, sid, weights, gate_up, down)
                    terms = part if terms is None else torch.where(mask[..., None], part, terms)
                out = terms.sum(1).to(x.dtype)
            self._start_prefetch(guess_ids)    # after this layer's kernels are queued: they run meanwhile
            return out
        # the reference's order: experts ascending, each added to one fp32 sum, then the shared expert
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        xf = x.float()
        for chunk in rounds:
            for e, s in zip(chunk, self.load(chunk)):
                token, k = torch.where(ids == e)
                gate, up = F.linear(xf[token], dequantize(_one(gate_up, s))).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, dequantize(_one(down, s)))
                out.index_add_(0, token, y * weights[token, k, None].float())
        moe_ops.add_shared_reference(out, xf, shared)
        self._start_prefetch(guess_ids)
        return out.to(x.dtype)


class ExpertCache:
    """All layers' slot pools of one model, with shared counters."""

    def __init__(self, layers: list[LayerExpertCache], stats: ExpertCacheStats, policy: str):
        self.layers, self.stats, self.policy = layers, stats, policy

    @property
    def slots_per_layer(self) -> int:
        return self.layers[0].num_slots

    @property
    def claim_pool(self):
        return self.layers[0].claim_pool

    def enable_graphs(self):
        """Decode steps read the pools through their slot tables (they may be captured) and admit their misses inside
        the step; → the ClaimPool (cache/expert_claim_pool.py), whose before_step / after_step DecodeGraphs calls
        around each such step (its `keeper`)."""
        return ClaimPool(self.layers)

    @property
    def device_bytes(self) -> int:
        return sum(c.num_slots * c.bytes_per_expert for c in self.layers)

    def __str__(self) -> str:
        gib = 1 << 30
        return (f"expert cache: {len(self.layers)} layers × {self.slots_per_layer}/{self.layers[0].num_experts} "
                f"slots = {self.device_bytes / gib:.2f} GiB on the device, eager-path policy {self.policy} (captured "
                f"decode steps: LRU)")


def install_expert_cache(model: torch.nn.Module, budget_bytes: int | None = None, policy: str = "lfu-decay",
                         *, slots_per_layer: int | None = None, device=None, prefetch: bool = True) -> ExpertCache:
    """Move every Int4Experts of `model` to a host store behind a pool of slots on `device` (default: where the
    experts are; experts loaded into host memory stay there, pinned in place). The slot count comes from
    `budget_bytes` (device bytes for all layers' pools) unless `slots_per_layer` is given. `prefetch`: each
    layer guesses the next layer's experts through its router (module docstring)."""
    from flashnext.models.layers.int4_experts import Int4Experts
    from flashnext.models.layers.moe import Experts, SparseMoe

    make_policy(policy, 1)  # an unknown policy fails before anything moves
    modules = [m for m in model.modules() if isinstance(m, Int4Experts)]
    if not modules:
        dense = any(isinstance(m, Experts) for m in model.modules())
        raise ValueError("--expert-vram-gb needs routed experts in INT4: add --quantize int4 (or load an INT4 "
                         "checkpoint)" if dense else "--expert-vram-gb: this model has no routed experts to cache")
    top_k, num_experts = model.cfg.num_experts_per_tok, modules[0].num_experts
    per_expert = max(sum(b[0].numel() * b.element_size() for b in m.buffers(recurse=False) if b is not None)
                     for m in modules)
    gib = 1 << 30
    if slots_per_layer is None:
        slots_per_layer = budget_bytes // (len(modules) * per_expert)
    if slots_per_layer < top_k:
        need = top_k * len(modules) * per_expert
        raise ValueError(f"--expert-vram-gb {(budget_bytes or 0) / gib:.3g} gives {slots_per_layer} expert slots per "
                         f"layer; each token is routed to {top_k} experts, so the cache needs at least {top_k} slots "
                         f"per layer ({need / gib:.3g} GiB for {len(modules)} layers of {per_expert} bytes per expert)")
    slots_per_layer = min(slots_per_layer, num_experts)
    device = torch.device(device) if device is not None else next(iter(modules[0].buffers())).device
    gpu = device.type == "cuda"
    stream = torch.cuda.Stream(device) if gpu else None
    stats = ExpertCacheStats()
    layers = [LayerExpertCache(m, slots_per_layer, policy, stats, device, stream) for m in modules]
    if prefetch:
        # Routers of MoE blocks whose experts are these modules themselves (expert parallel wraps them with an id
        # offset: no prefetch there), in model order.
        router_of = {id(m.experts): m.gate for m in model.modules() if isinstance(m, SparseMoe)}
        for layer, following in zip(layers, layers[1:]):
            if id(following.module) in router_of:
                layer.next_router, layer.next_cache = router_of[id(following.module)], following
    cache = ExpertCache(layers, stats, policy)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log.info("%s", cache)
    return cache
