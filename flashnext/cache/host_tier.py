"""The host-RAM tier of the prefix cache: KV blocks and snapshots evicted from device memory (or written
through at the end of every turn) wait here, in pinned memory when CUDA is present so the copies back
are plain DMA, until a request hits them or they are evicted in turn (to disk when configured).
The index is TierIndex; this is where the payloads sit (on several ranks, one such store per rank)."""
from __future__ import annotations

import torch

from flashnext.cache.cache_entry import copy_tensors, tensor_bytes
from flashnext.cache.tier_index import BlockData, SnapshotData, SnapshotMeta, TierStore


class HostStore(TierStore):
    name = "host"

    def __init__(self):
        self.pin = torch.cuda.is_available()
        self.block_data: dict[bytes, BlockData] = {}
        self.snapshot_data: dict[bytes, SnapshotData] = {}

    def store_block(self, h: bytes, data: BlockData) -> int:
        self.block_data[h] = copy_tensors(data, "cpu", self.pin)
        return tensor_bytes(data)

    def store_snapshot(self, key: bytes, snap: SnapshotData, meta: SnapshotMeta | None) -> int:
        state, tail_kv = snap
        self.snapshot_data[key] = (copy_tensors(state, "cpu", self.pin),
                                   copy_tensors(tail_kv, "cpu", self.pin) if tail_kv is not None else None)
        return tensor_bytes(state) + tensor_bytes(tail_kv)

    def load_block(self, h: bytes) -> BlockData:
        return self.block_data[h]

    def load_snapshot(self, key: bytes) -> SnapshotData:
        return self.snapshot_data[key]

    def drop_block(self, h: bytes) -> None:
        del self.block_data[h]

    def drop_snapshot(self, key: bytes) -> None:
        del self.snapshot_data[key]
