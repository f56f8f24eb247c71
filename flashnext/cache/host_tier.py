"""The host-RAM tier of the prefix cache: KV blocks and snapshots evicted from device memory (or written
through at the end of every turn) wait here, in pinned memory when CUDA is present so the copies back
are plain DMA, until a request hits them or they are evicted in turn (to disk when configured).
The index is TierIndex; this is where the payloads sit (on several ranks, one such store per rank).

Host buffers come from a PinnedArena (page-locked slabs, buffers recycled when entries are dropped), not from a
page-locking allocation per entry. Blocks that come down together (a conversation's new blocks) stay together:
tensors per tensor of the KV pool, views of one buffer, hold the batch (in a few pieces of power-of-two block counts), each block is a row, and blocks stored
together load back as a few runs of views (no copy) — a few transfers per tensor instead of one per block
and tensor. A batch's memory is
freed when its last block is dropped; until then the tier's byte count (its blocks') can be below what the
batch holds.
"""
from __future__ import annotations

import logging
import time

import torch

from flashnext.cache.cache_entry import copy_tensors, packed_bytes, tensor_bytes
from flashnext.cache.host_copies import HostCopies
from flashnext.cache.pinned_arena import PinnedArena
from flashnext.cache.tier_index import BlockData, SnapshotData, SnapshotMeta, TierStore, row_runs
from flashnext.weights.pinned import meminfo_bytes

log = logging.getLogger("flashnext.cache")


class HostStore(TierStore):
    name = "host"

    def __init__(self, capacity: int = 0):
        """`capacity`: bytes of buffers the arena may page-lock for reuse (the tier's budget; entries it cannot
        serve get an allocation of their own)."""
        self.pin = torch.cuda.is_available()
        self.arena = PinnedArena(capacity, self.pin)
        if self.pin:   # page-locked now, not inside the write-downs that make room for requests (pinned_arena.py)
            available = meminfo_bytes("MemAvailable")
            if available is not None and capacity > available:
                raise ValueError(f"the host tier's {capacity / 2**30:.1f} GiB (--kv-host-gb, per rank) is more than the "
                                 f"{available / 2**30:.1f} GiB of host memory available: page-locking it would fail or "
                                 "starve the system")
            started = time.perf_counter()
            self.arena.reserve()
            log.info("host tier: %.1f GiB page-locked in %.1f s", self.arena.reserved / 2**30,
                     time.perf_counter() - started)
        self.buffers: dict[object, list[torch.Tensor]] = {}   # batch id or snapshot key → its host buffers
        self.batches: dict[int, BlockData] = {}          # batch id → name → [rows, …]
        self.live_rows: dict[int, int] = {}              # batch id → rows still stored
        self.rows: dict[bytes, tuple[int, int]] = {}     # block hash → (batch id, row)
        self.snapshot_data: dict[bytes, SnapshotData] = {}
        self._next_batch = 0
        self.copies = HostCopies() if self.pin else None   # copies down not waited for (host_copies.py)

    def store_blocks(self, hashes: list[bytes], batch: BlockData) -> list[int]:
        # Pieces of power-of-two block counts (a batch of TierIndex.put is at most WRITE_PIECE = 256 blocks; its
        # last of a 3,625-block conversation, 41 blocks, is 32 + 8 + 1): pieces come in few sizes, which the
        # arena recycles by size, and an allocation of its own when the arena misses (torch rounds those up to a
        # power of two) loses nothing, a block's tensors being powers of two (16 KB of K or V per layer).
        at = 0
        for size in _powers_of_two(len(hashes)):
            batch_id, self._next_batch = self._next_batch, self._next_batch + 1
            piece = {name: t[at: at + size] for name, t in batch.items()}
            self.batches[batch_id] = self._copy(batch_id, piece)
            self.live_rows[batch_id] = size
            for row, h in enumerate(hashes[at: at + size]):
                self.rows[h] = (batch_id, row)
            at += size
        return [tensor_bytes(batch) // len(hashes)] * len(hashes)

    def store_snapshot(self, key: bytes, snap: SnapshotData, meta: SnapshotMeta | None) -> int:
        state, tail_kv = snap
        self.snapshot_data[key] = (self._copy(key, state), self._copy(key, tail_kv) if tail_kv is not None else None)
        return tensor_bytes(state) + tensor_bytes(tail_kv)

    def _copy(self, owner, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of `tensors` in one buffer from the arena (or a fresh one), kept under `owner`."""
        buf = self.arena.take(packed_bytes(tensors))
        if self.copies is not None and all(t.is_cuda for t in tensors.values()):
            out = self.copies.copy(owner, tensors, buf)
        else:
            out = copy_tensors(tensors, "cpu", self.pin, into=buf)
        if buf is not None:
            self.buffers.setdefault(owner, []).append(buf)
        return out

    def _written(self, owner) -> None:
        """Before the host buffers of `owner` are read: its copies down are done."""
        if self.copies is not None:
            self.copies.wait(owner)

    def copying(self) -> bool:
        """Whether copies down are still in flight (HostCopies.busy)."""
        return self.copies is not None and self.copies.busy()

    def flush(self) -> None:
        if self.copies is not None:
            self.copies.wait_all()

    def _release(self, owner) -> None:
        copying = self.copies.pending(owner) if self.copies is not None else None   # the arena waits for it
        for buf in self.buffers.pop(owner, ()):
            self.arena.give_back(buf, copying)

    def load_blocks(self, hashes: list[bytes]) -> list[BlockData]:
        runs = row_runs([self.rows[h] for h in hashes])
        for batch_id, _, _ in runs:
            self._written(batch_id)
        return [{name: t[first: first + n] for name, t in self.batches[batch_id].items()} for batch_id, first, n in runs]

    def load_snapshot(self, key: bytes) -> SnapshotData:
        self._written(key)
        return self.snapshot_data[key]

    def drop_block(self, h: bytes) -> None:
        batch_id, _ = self.rows.pop(h)
        self.live_rows[batch_id] -= 1
        if self.live_rows[batch_id] == 0:
            del self.live_rows[batch_id], self.batches[batch_id]
            self._release(batch_id)

    def drop_snapshot(self, key: bytes) -> None:
        del self.snapshot_data[key]
        self._release(key)


def _powers_of_two(n: int) -> list[int]:
    """n as a sum of distinct powers of two, largest first."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]
