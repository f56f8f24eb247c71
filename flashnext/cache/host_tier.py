"""The host-RAM tier of the prefix cache: KV blocks and snapshots evicted from device memory (or written
through at the end of every turn) wait here, in pinned memory when CUDA is present so the copies back
are plain DMA, until a request hits them or they are evicted in turn (to disk when configured).
The index is TierIndex; this is where the payloads sit (on several ranks, one such store per rank).

Blocks that come down together (a conversation's new blocks) stay together: pinned tensors per tensor of the
KV pool hold the batch (in a few pieces of power-of-two block counts), each block is a row, and blocks stored
together load back as a few runs of views (no copy) — a few transfers per tensor instead of one per block
and tensor. A batch's memory is
freed when its last block is dropped; until then the tier's byte count (its blocks') can be below what the
batch holds.
"""
from __future__ import annotations

import torch

from flashnext.cache.cache_entry import copy_tensors, tensor_bytes
from flashnext.cache.tier_index import BlockData, SnapshotData, SnapshotMeta, TierStore


class HostStore(TierStore):
    name = "host"

    def __init__(self):
        self.pin = torch.cuda.is_available()
        self.batches: dict[int, BlockData] = {}          # batch id → name → [rows, …]
        self.live_rows: dict[int, int] = {}              # batch id → rows still stored
        self.rows: dict[bytes, tuple[int, int]] = {}     # block hash → (batch id, row)
        self.snapshot_data: dict[bytes, SnapshotData] = {}
        self._next_batch = 0

    def store_blocks(self, hashes: list[bytes], batch: BlockData) -> list[int]:
        # Pieces of power-of-two block counts (a batch of TierIndex.put is at most WRITE_PIECE = 256 blocks; its
        # last of a 3,625-block conversation, 41 blocks, is 32 + 8 + 1): the pinned
        # allocator rounds every allocation up to a power of two, and a block's tensors are powers of two
        # (16 KB of K or V per layer for Flash-Next), so the pinned memory is what the tier counts.
        at = 0
        for size in _powers_of_two(len(hashes)):
            batch_id, self._next_batch = self._next_batch, self._next_batch + 1
            piece = {name: t[at: at + size] for name, t in batch.items()}
            self.batches[batch_id] = copy_tensors(piece, "cpu", self.pin)
            self.live_rows[batch_id] = size
            for row, h in enumerate(hashes[at: at + size]):
                self.rows[h] = (batch_id, row)
            at += size
        return [tensor_bytes(batch) // len(hashes)] * len(hashes)

    def store_block(self, h: bytes, data: BlockData) -> int:
        return self.store_blocks([h], {name: t.unsqueeze(0) for name, t in data.items()})[0]

    def store_snapshot(self, key: bytes, snap: SnapshotData, meta: SnapshotMeta | None) -> int:
        state, tail_kv = snap
        self.snapshot_data[key] = (copy_tensors(state, "cpu", self.pin),
                                   copy_tensors(tail_kv, "cpu", self.pin) if tail_kv is not None else None)
        return tensor_bytes(state) + tensor_bytes(tail_kv)

    def load_blocks(self, hashes: list[bytes]) -> list[BlockData]:
        runs: list[tuple[int, int, int]] = []    # (batch id, first row, rows)
        for h in hashes:
            batch_id, row = self.rows[h]
            if runs and runs[-1][0] == batch_id and runs[-1][1] + runs[-1][2] == row:
                runs[-1] = (batch_id, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((batch_id, row, 1))
        return [{name: t[first: first + n] for name, t in self.batches[batch_id].items()}
                for batch_id, first, n in runs]

    def load_block(self, h: bytes) -> BlockData:
        batch_id, row = self.rows[h]
        return {name: t[row] for name, t in self.batches[batch_id].items()}

    def load_snapshot(self, key: bytes) -> SnapshotData:
        return self.snapshot_data[key]

    def drop_block(self, h: bytes) -> None:
        batch_id, _ = self.rows.pop(h)
        self.live_rows[batch_id] -= 1
        if self.live_rows[batch_id] == 0:
            del self.live_rows[batch_id], self.batches[batch_id]

    def drop_snapshot(self, key: bytes) -> None:
        del self.snapshot_data[key]


def _powers_of_two(n: int) -> list[int]:
    """n as a sum of distinct powers of two, largest first."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]
