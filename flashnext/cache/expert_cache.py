"""Routed experts kept in host memory with a pool of device slots per layer (`--expert-vram-gb`).

Each `Int4Experts` of the model keeps its stacked INT4 tensors (docs/int4.md's kernel layout) in a host store
— pinned when CUDA is present, so host→device copies are DMA — and its buffers become a device pool of S
expert slots in the same layout. A forward maps the routed expert ids to slots through a slot table; the
experts missing from the pool are copied in first, one batched copy per tensor of the layout per layer (on a
dedicated CUDA stream on the GPU, a plain copy on the CPU). The experts a step needs are pinned while it runs;
the rest are evicted by the policy (flashnext/cache/expert_policy.py).

A step that routes to more distinct experts than S (a prefill) runs in rounds of at most S experts, in expert
order. On the CPU every round sums each expert's output into one fp32 accumulator in the same order as
`moe_int4_reference`, so the result is bit-identical to all-resident at any budget.
Counting: one read per (layer, forward, distinct routed expert): hits + misses = reads.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashnext.cache.expert_policy import make_policy
from flashnext.ops import moe_int4 as moe_ops
from flashnext.weights.int4_layout import Int4Weight, dequantize
from flashnext.weights.pinned import host_empty, pin_in_place

log = logging.getLogger("flashnext.expert_cache")


@dataclass
class ExpertCacheStats:
    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0
    stall_seconds: float = 0.0   # wall time spent copying misses in (the forward waits for it)

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
        self.module, self.num_slots, self.stats, self.device = module, num_slots, stats, device
        self.num_experts = module.num_experts
        self.policy = make_policy(policy, self.num_experts)
        self.copy_stream = copy_stream
        pin = torch.cuda.is_available()
        self.names = [n for n, b in module.named_buffers(recurse=False) if b is not None]
        self.host, self.staging = {}, {}
        for name in self.names:
            full = getattr(module, name).detach()
            if full.device.type == "cpu":      # loaded into host memory already (load_model with an expert budget)
                host = pin_in_place(full.contiguous(), "the expert store") if pin else full
            else:
                host = host_empty(tuple(full.shape), full.dtype, pin, "the expert store")
                host.copy_(full)
            self.host[name] = host
            if pin:
                self.staging[name] = torch.empty((num_slots, *host.shape[1:]), dtype=host.dtype).pin_memory()
            setattr(module, name, torch.zeros((num_slots, *full.shape[1:]), dtype=full.dtype, device=device))
            del full
        self.bytes_per_expert = sum(t[0].numel() * t.element_size() for t in self.host.values())
        self.slot_of = torch.full((self.num_experts,), -1, dtype=torch.long)        # expert → slot (host copy)
        self.slot_table = torch.full((self.num_experts,), -1, dtype=torch.long, device=device)
        self.free = list(range(num_slots))
        module.expert_cache = self

    def load(self, experts: list[int]) -> list[int]:
        """Make `experts` (distinct, ≤ num_slots) resident; → their slots. Only other experts are evicted."""
        need = torch.tensor(experts, dtype=torch.long)
        self.policy.access(need)
        missing = need[self.slot_of[need] < 0]
        self.stats.hits += len(need) - len(missing)
        self.stats.misses += len(missing)
        if len(missing):
            shortfall = len(missing) - len(self.free)
            if shortfall > 0:
                candidates = self.slot_of >= 0
                candidates[need] = False
                victims = self.policy.victims(candidates, shortfall)
                self.free += self.slot_of[victims].tolist()
                self.slot_of[victims] = -1
            slots = torch.tensor([self.free.pop() for _ in range(len(missing))], dtype=torch.long)
            self.slot_of[missing] = slots
            self._copy_in(missing, slots)
            self.slot_table.copy_(self.slot_of)
        return self.slot_of[need].tolist()

    def _copy_in(self, experts: torch.Tensor, slots: torch.Tensor) -> None:
        start = time.perf_counter()
        if self.copy_stream is None:
            for name in self.names:
                getattr(self.module, name).index_copy_(0, slots.to(self.device), self.host[name].index_select(0, experts))
        else:
            m = len(experts)
            with torch.cuda.stream(self.copy_stream):
                dst = slots.to(self.device, non_blocking=True)
                for name in self.names:
                    staged = torch.index_select(self.host[name], 0, experts, out=self.staging[name][:m])
                    getattr(self.module, name).index_copy_(0, dst, staged.to(self.device, non_blocking=True))
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            self.copy_stream.synchronize()  # the staging rows are reused next call; also makes the stall measurable
        self.stats.stall_seconds += time.perf_counter() - start
        self.stats.bytes_copied += len(experts) * self.bytes_per_expert

    def forward(self, x, weights, ids):
        """Int4Experts.forward through the slot pool (same maths as ops.moe_int4)."""
        experts = ids.unique().tolist()
        rounds = [experts[i:i + self.num_slots] for i in range(0, len(experts), self.num_slots)]
        gate_up, down = self.module.weight_int4("gate_up"), self.module.weight_int4("down")
        if x.is_cuda and moe_ops._BACKEND != "reference":
            if len(rounds) == 1:
                self.load(experts)
                return moe_ops.moe_int4(x, self.slot_table[ids], weights, gate_up, down)
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for chunk in rounds:
                slots = self.load(chunk)
                mask = torch.isin(ids, torch.tensor(chunk, device=ids.device))
                sid = torch.where(mask, self.slot_table[ids], slots[0])
                out += moe_ops.moe_int4(x, sid, torch.where(mask, weights, 0), gate_up, down).float()
            return out.to(x.dtype)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        xf = x.float()
        for chunk in rounds:
            for e, s in zip(chunk, self.load(chunk)):
                token, k = torch.where(ids == e)
                gate, up = F.linear(xf[token], dequantize(_one(gate_up, s))).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, dequantize(_one(down, s)))
                out.index_add_(0, token, y * weights[token, k, None].float())
        return out.to(x.dtype)


class ExpertCache:
    """All layers' slot pools of one model, with shared counters."""

    def __init__(self, layers: list[LayerExpertCache], stats: ExpertCacheStats, policy: str):
        self.layers, self.stats, self.policy = layers, stats, policy

    @property
    def slots_per_layer(self) -> int:
        return self.layers[0].num_slots

    @property
    def device_bytes(self) -> int:
        return sum(c.num_slots * c.bytes_per_expert for c in self.layers)

    def __str__(self) -> str:
        gib = 1 << 30
        return (f"expert cache: {len(self.layers)} layers × {self.slots_per_layer}/{self.layers[0].num_experts} "
                f"slots = {self.device_bytes / gib:.2f} GiB on the device, policy {self.policy}")


def install_expert_cache(model: torch.nn.Module, budget_bytes: int | None = None, policy: str = "lfu-decay",
                         *, slots_per_layer: int | None = None, device=None) -> ExpertCache:
    """Move every Int4Experts of `model` to a host store behind a pool of slots on `device` (default: where the
    experts are; experts loaded into host memory stay there, pinned in place). The slot count comes from
    `budget_bytes` (device bytes for all layers' pools) unless `slots_per_layer` is given."""
    from flashnext.models.layers.int4_experts import Int4Experts
    from flashnext.models.layers.moe import Experts

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
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    stats = ExpertCacheStats()
    layers = [LayerExpertCache(m, slots_per_layer, policy, stats, device, stream) for m in modules]
    cache = ExpertCache(layers, stats, policy)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log.info("%s", cache)
    return cache
