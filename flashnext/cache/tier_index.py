"""The index shared by the lower cache tiers (host RAM, disk): content-addressed KV blocks and snapshots
under a byte budget, least recently used out first.

A snapshot names the blocks of its prefix by hash; a block is kept while some snapshot names it, so the
common prefix of a conversation's turns is stored once. Subclasses keep the payloads; an evicted
snapshot moves to the next tier down (`lower`) when there is one, else it is dropped.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from flashnext.cache.cache_entry import ROOT_HASH, Snapshot, chain_hashes

log = logging.getLogger("flashnext.cache")

BlockData = dict[str, torch.Tensor]


class CorruptEntry(RuntimeError):
    pass


@dataclass
class SnapshotMeta:
    blocks: list[bytes]          # hashes of its full blocks, in order
    tail: tuple[int, ...]
    num_tokens: int
    nbytes: int


class TierIndex:
    name = "tier"

    def __init__(self, capacity_bytes: int, block_size: int, lower: TierIndex | None = None):
        self.capacity = capacity_bytes
        self.block_size = block_size
        self.lower = lower
        self.block_refs: dict[bytes, int] = {}
        self.block_bytes: dict[bytes, int] = {}
        self.snaps: OrderedDict[bytes, SnapshotMeta] = OrderedDict()
        self.by_last_block: dict[bytes, dict[tuple[int, ...], bytes]] = {}
        self.bytes = 0

    # ---- payloads, kept by subclasses ----
    def _store_block(self, h: bytes, data: BlockData) -> int:
        raise NotImplementedError

    def _store_snapshot(self, key: bytes, meta: SnapshotMeta, snap: Snapshot) -> int:
        raise NotImplementedError

    def _load_block(self, h: bytes) -> BlockData:
        raise NotImplementedError

    def _load_snapshot(self, key: bytes, meta: SnapshotMeta) -> Snapshot:
        raise NotImplementedError

    def _drop_block(self, h: bytes) -> None:
        raise NotImplementedError

    def _drop_snapshot(self, key: bytes) -> None:
        raise NotImplementedError

    # ---- the index ----
    def __contains__(self, key: bytes) -> bool:
        return key in self.snaps

    def match(self, tokens: list[int], limit: int, deeper_than: int = 0) -> tuple[bytes, SnapshotMeta] | None:
        """The deepest snapshot of a prefix of tokens[:limit] with more than `deeper_than` tokens."""
        if not self.snaps:
            return None
        bs = self.block_size
        hashes = chain_hashes(tokens, bs, limit // bs)
        for d in range(limit // bs, -1, -1):
            if d * bs + bs - 1 <= deeper_than:
                break
            best = None
            for tail, key in self.by_last_block.get(hashes[d], {}).items():
                n = d * bs + len(tail)
                if deeper_than < n <= limit and tuple(tokens[d * bs:n]) == tail and (best is None or n > best[1].num_tokens):
                    best = (key, self.snaps[key])
            if best is not None:
                return best
        return None

    def put(self, hashes: list[bytes], get_block: Callable[[int], BlockData], key: bytes, snap: Snapshot) -> None:
        """Store a snapshot and whichever of its prefix blocks are missing (get_block(i) reads block i)."""
        if key in self.snaps:
            self.snaps.move_to_end(key)
            return
        for i, h in enumerate(hashes):
            if h not in self.block_refs:
                nbytes = self._store_block(h, get_block(i))
                self.block_refs[h], self.block_bytes[h] = 0, nbytes
                self.bytes += nbytes
            self.block_refs[h] += 1
        meta = SnapshotMeta(list(hashes), tuple(snap.tail), snap.num_tokens, 0)
        meta.nbytes = self._store_snapshot(key, meta, snap)
        self._index(key, meta)
        self._fit()

    def _index(self, key: bytes, meta: SnapshotMeta) -> None:
        self.snaps[key] = meta
        self.by_last_block.setdefault(meta.blocks[-1] if meta.blocks else ROOT_HASH, {})[meta.tail] = key
        self.bytes += meta.nbytes

    def load(self, key: bytes) -> tuple[list[BlockData], Snapshot] | None:
        """The blocks and snapshot of an entry, or None (with a warning) when it cannot be read back."""
        meta = self.snaps[key]
        try:
            blocks = [self._load_block(h) for h in meta.blocks]
            snap = self._load_snapshot(key, meta)
        except (CorruptEntry, OSError) as e:
            log.warning("%s cache: ignoring entry %s: %s", self.name, key.hex(), e)
            self._remove(key)
            return None
        self.snaps.move_to_end(key)
        return blocks, snap

    def _fit(self) -> None:
        while self.bytes > self.capacity and self.snaps:
            self.evict(next(iter(self.snaps)))

    def evict(self, key: bytes) -> None:
        meta = self.snaps[key]
        if self.lower is not None and key not in self.lower:
            entry = self.load(key)
            if entry is None:
                return
            blocks, snap = entry
            self.lower.put(meta.blocks, lambda i: blocks[i], key, snap)
        self._remove(key)

    def _remove(self, key: bytes) -> None:
        meta = self.snaps.pop(key)
        last = meta.blocks[-1] if meta.blocks else ROOT_HASH
        tails = self.by_last_block[last]
        del tails[meta.tail]
        if not tails:
            del self.by_last_block[last]
        self.bytes -= meta.nbytes
        self._drop_snapshot(key)
        for h in meta.blocks:
            self.block_refs[h] -= 1
            if self.block_refs[h] == 0:
                del self.block_refs[h]
                self.bytes -= self.block_bytes.pop(h)
                self._drop_block(h)

    def clear(self) -> None:
        """Forget every entry without moving it down."""
        while self.snaps:
            self._remove(next(iter(self.snaps)))
