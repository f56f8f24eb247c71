"""The host-RAM tier of the prefix cache: KV blocks and snapshots evicted from device memory (or written
through at the end of every turn) wait here, in pinned memory when CUDA is present so the copies back
are plain DMA, until a request hits them or they are evicted in turn (to disk when configured)."""
from __future__ import annotations

import torch

from flashnext.cache.cache_entry import Snapshot, copy_tensors, tensor_bytes
from flashnext.cache.tier_index import BlockData, SnapshotMeta, TierIndex


class HostTier(TierIndex):
    name = "host"

    def __init__(self, capacity_bytes: int, block_size: int, lower: TierIndex | None = None):
        super().__init__(capacity_bytes, block_size, lower)
        self.pin = torch.cuda.is_available()
        self.block_data: dict[bytes, BlockData] = {}
        self.snapshot_data: dict[bytes, Snapshot] = {}

    def _store_block(self, h: bytes, data: BlockData) -> int:
        self.block_data[h] = copy_tensors(data, "cpu", self.pin)
        return tensor_bytes(data)

    def _store_snapshot(self, key: bytes, meta: SnapshotMeta, snap: Snapshot) -> int:
        self.snapshot_data[key] = snap.to("cpu", self.pin)
        return snap.nbytes

    def _load_block(self, h: bytes) -> BlockData:
        return self.block_data[h]

    def _load_snapshot(self, key: bytes, meta: SnapshotMeta) -> Snapshot:
        return self.snapshot_data[key]

    def _drop_block(self, h: bytes) -> None:
        del self.block_data[h]

    def _drop_snapshot(self, key: bytes) -> None:
        del self.snapshot_data[key]
