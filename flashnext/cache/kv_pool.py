"""Paged KV memory for the attention layers, plus the QSA indexer's compressed block keys.

Pages of `block_size` tokens; a sequence owns a list of block ids. For indexed attention each page also
holds block_size / compress_ratio pooled indexer keys (normed and RoPE'd, final: a complete block's
pooled key never changes), 4× smaller than caching raw indexer keys. This pool is the one place that
knows how much device memory attention state takes.
"""
from __future__ import annotations

import torch

from flashnext.weights.config import ModelConfig


class OutOfBlocks(RuntimeError):
    pass


class KVPool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        if cfg.indexer_compress_ratio and block_size % cfg.indexer_compress_ratio:
            raise ValueError(f"block_size {block_size} must be a multiple of indexer_compress_ratio {cfg.indexer_compress_ratio}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.dtype = dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in cfg.attention_layers()}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in cfg.attention_layers()}
        self.index_keys = {}
        if cfg.arch == "qwen4_exp":
            per_block = block_size // cfg.indexer_compress_ratio
            self.index_keys = {i: torch.zeros(num_blocks, per_block, cfg.indexer_head_dim, dtype=dtype, device=device)
                               for i in cfg.attention_layers()}
        self._free = list(range(num_blocks - 1, -1, -1))
        self.refcount = [0] * num_blocks
        # release() calls so far: a block given up by its last request but still named by the prefix cache frees
        # nothing, yet makes it evictable (PrefixCache.waiting_for_read retries an install when this moves)
        self.releases = 0

    @staticmethod
    def fit_block_size(cfg: ModelConfig, preferred: int) -> int:
        """The block size nearest `preferred` that holds whole indexer blocks."""
        ratio = cfg.indexer_compress_ratio or 1
        return ratio * max(1, round(preferred / ratio))

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elt = torch.empty(0, dtype=dtype).element_size()
        per_layer = 2 * block_size * cfg.num_kv_heads * cfg.head_dim
        if cfg.arch == "qwen4_exp":
            per_layer += block_size // cfg.indexer_compress_ratio * cfg.indexer_head_dim
        return per_layer * len(cfg.attention_layers()) * elt

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        # ascending: blocks freed together come back as a run, which a lower tier's entry is copied into at once
        # (cache_entry.write_blocks; the free list hands them out last freed first, descending)
        blocks = sorted(self._free.pop() for _ in range(n))
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.refcount[b] > 0, "sharing a free block"
            self.refcount[b] += 1

    def release(self, blocks: list[int]) -> None:
        if blocks:
            self.releases += 1
        self._drop_refs(blocks)

    def unshare(self, blocks: list[int]) -> None:
        """Undo share(): an admission that did not happen gives nothing up (not counted in `releases`)."""
        self._drop_refs(blocks)

    def _drop_refs(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.refcount[b] > 0, f"double free of block {b}"
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def token_rows(self, blocks: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Flat row ids (block * block_size + offset) of token positions [start, end) of a sequence."""
        pos = torch.arange(start, end, device=blocks.device)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size
