"""One sequence run directly against a model, with its own small pools.

The simplest correct way to use a model: tests compare it with the oracle, and the engine's batched
runs are checked against it. The engine does the same thing for many sequences at once.
"""
from __future__ import annotations

import torch

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.state_pool import StatePool
from flashnext.models.context import ForwardContext, Segment


class Session:
    def __init__(self, model, max_len: int, block_size: int | None = None, device=None, dtype=None):
        cfg = model.cfg
        param = next(model.parameters())
        self.device = device or param.device
        dtype = dtype or param.dtype
        self.model = model
        block_size = block_size or KVPool.fit_block_size(cfg, 16)
        self.kv = KVPool(cfg, -(-max_len // block_size), block_size, dtype, self.device)
        self.states = StatePool(cfg, 1, dtype, self.device)
        self.slot = self.states.allocate()
        self.blocks = torch.tensor(self.kv.allocate(self.kv.num_blocks), device=self.device)
        self.length = 0
        self.max_len = max_len

    @torch.inference_mode()
    def extend(self, token_ids, all_logits: bool = False) -> torch.Tensor:
        """Feed tokens; returns logits of every new token ([T, V]) or of the last one ([V])."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if self.length + ids.numel() > self.max_len:
            raise ValueError(f"session holds {self.max_len} tokens; {self.length} + {ids.numel()} do not fit")
        seg = Segment(self.slot, self.blocks, 0, ids.numel(), self.length)
        hidden = self.model(ids, ForwardContext([seg], self.kv, self.states))
        self.length += ids.numel()
        return self.model.compute_logits(hidden if all_logits else hidden[-1])

    def greedy(self, prompt, n: int) -> list[int]:
        """Feed `prompt`, then take the argmax token n times: the reference every batched path must equal."""
        logits, out = self.extend(prompt), []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = self.extend([out[-1]])
        return out
