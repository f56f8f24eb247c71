"""Fixed-size per-sequence state in slots: GatedDeltaNet conv tail and recurrent S (fp32), the PLE
token and conv history, the QSA indexer's ring of raw keys of the incomplete block.

A slot is reset when a sequence starts; snapshots (prefix cache, host tier, preemption) copy slots.
"""
from __future__ import annotations

import torch

from flashnext.weights.config import ModelConfig


class OutOfSlots(RuntimeError):
    pass


class StatePool:
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device):
        self.cfg = cfg
        self.num_slots = num_slots
        self.device = torch.device(device)
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        self.conv = {i: torch.zeros(num_slots, cfg.linear_conv_kernel - 1, conv_dim, dtype=dtype, device=device)
                     for i in cfg.linear_layers()}
        self.ssm = {i: torch.zeros(num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                   cfg.linear_value_head_dim, dtype=torch.float32, device=device)
                    for i in cfg.linear_layers()}
        self.ple_ids = {i: torch.zeros(num_slots, cfg.ngram_size - 1, dtype=torch.long, device=device) for i in cfg.ple_layers}
        ple_span = (cfg.ple_conv_kernel - 1) * cfg.ngram_size
        self.ple_conv = {i: torch.zeros(num_slots, ple_span, cfg.hc_hidden_size, dtype=dtype, device=device)
                         for i in cfg.ple_layers}
        self.index_ring = {}
        if cfg.arch == "qwen4_exp":
            self.index_ring = {i: torch.zeros(num_slots, cfg.indexer_compress_ratio - 1, cfg.indexer_head_dim,
                                              dtype=dtype, device=device) for i in cfg.attention_layers()}
        self._free = list(range(num_slots - 1, -1, -1))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every per-slot tensor, by a stable name (slot is dim 0)."""
        out = {}
        for group in ("conv", "ssm", "ple_ids", "ple_conv", "index_ring"):
            for layer, t in getattr(self, group).items():
                out[f"{group}.{layer}"] = t
        return out

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
        pool = StatePool(cfg, 1, dtype, "meta")
        return sum(t.numel() * t.element_size() for t in pool.tensors().values())

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots("no free state slot")
        slot = self._free.pop()
        self.reset(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"double free of slot {slot}"
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        for name, t in self.tensors().items():
            # A fresh PLE history is all EOS: the n-gram hash treats the start like a document boundary.
            t[slot] = self.cfg.eos_token_id if name.startswith("ple_ids") else 0

    def snapshot(self, slot: int) -> dict[str, torch.Tensor]:
        return {name: t[slot].clone() for name, t in self.tensors().items()}

    def restore(self, slot: int, snap: dict[str, torch.Tensor]) -> None:
        for name, t in self.tensors().items():
            t[slot].copy_(snap[name], non_blocking=True)

    def copy_slot(self, src: int, dst: int) -> None:
        for t in self.tensors().values():
            t[dst].copy_(t[src])
