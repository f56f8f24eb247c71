"""The index shared by the lower cache tiers (host RAM, disk): content-addressed KV blocks and snapshots
under a byte budget, least recently used out first.

A snapshot names the blocks of its prefix by hash; a block is kept while some snapshot names it, so the
common prefix of a conversation's turns is stored once. The payloads live in a `TierStore`; an evicted
snapshot moves to the next tier down (`lower`) when there is one, else it is dropped.

The index and its store are apart because on several ranks only rank 0 has the index (it decides what is
kept), while every rank has a store of its own for its share of each entry (flashnext/parallel/mirror.py):
each payload this index stores or drops is then logged to the mirror, for the other ranks to do the same.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from flashnext.cache.cache_entry import ROOT_HASH, WRITE_PIECE, Snapshot, batch_rows, chain_hashes

log = logging.getLogger("flashnext.cache")

BlockData = dict[str, torch.Tensor]
SnapshotData = tuple[dict[str, torch.Tensor], BlockData | None]     # state, KV of the partial block (or None)


class CorruptEntry(RuntimeError):
    pass


@dataclass
class SnapshotMeta:
    blocks: list[bytes]          # hashes of its full blocks, in order
    tail: tuple[int, ...]
    num_tokens: int
    nbytes: int


def row_runs(places: list[tuple[object, int]]) -> list[tuple[object, int, int]]:
    """(batch, row) of each block, in order → runs (batch, first row, rows) of consecutive rows of one batch: what a
    store that keeps blocks as rows of batches gives back as few runs (TierStore.load_blocks)."""
    runs: list[tuple[object, int, int]] = []
    batch_now, first, count = None, 0, 0     # the run under way (a 58K-token Flash-Next entry has ~3,600 rows)
    for batch, row in places:
        if count and batch == batch_now and row == first + count:
            count += 1
            continue
        if count:
            runs.append((batch_now, first, count))
        batch_now, first, count = batch, row, 1
    if count:
        runs.append((batch_now, first, count))
    return runs


class TierStore:
    """Payloads of one tier by name; returns the bytes each stored payload takes."""
    name = "tier"
    # Bytes the store holds for blocks no longer stored (a disk batch file's dropped rows, until the file goes): the
    # index counts them against its budget too.
    dead_bytes = 0

    def stored_bytes(self, payload_bytes: int) -> int:
        """What a payload of this many tensor bytes takes here, as the store_* methods count it."""
        return payload_bytes

    def store_blocks(self, hashes: list[bytes], batch: BlockData) -> list[int]:
        """Several blocks at once, `batch` holding them as rows (name → [len(hashes), …])."""
        raise NotImplementedError

    def store_snapshot(self, key: bytes, snap: SnapshotData, meta: SnapshotMeta | None) -> int:
        """`meta` is what the index knows of the entry (the disk keeps it for a restart); None on ranks > 0."""
        raise NotImplementedError

    def load_blocks(self, hashes: list[bytes]) -> list[BlockData]:
        """The blocks in order, as runs: batches whose rows, one run after the other, are the blocks."""
        raise NotImplementedError

    def load_snapshot(self, key: bytes) -> SnapshotData:
        raise NotImplementedError

    def drop_block(self, h: bytes) -> None:
        raise NotImplementedError

    def drop_snapshot(self, key: bytes) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Wait until every store and drop issued so far is done (for a store that writes in the background)."""

    def touch(self, key: bytes) -> None:
        """Mark a stored snapshot as just used, where the store keeps that order itself (the disk: file times)."""


class TierIndex:
    def __init__(self, store: TierStore, capacity_bytes: int, block_size: int, lower: TierIndex | None = None):
        self.store = store
        self.capacity = capacity_bytes
        self.block_size = block_size
        self.lower = lower
        self.block_refs: dict[bytes, int] = {}
        self.block_bytes: dict[bytes, int] = {}
        self.snaps: OrderedDict[bytes, SnapshotMeta] = OrderedDict()
        self.by_last_block: dict[bytes, dict[tuple[int, ...], bytes]] = {}
        self.bytes = 0
        # Entries being copied up (PrefixCache.lookup): the install evicts device entries down, and their way in
        # must not push out the entry whose loaded views are being read (the host tier reuses a dropped entry's
        # buffers); fit() passes them over, the tier may exceed its bytes until the install ends.
        self.installing: set[bytes] = set()
        # Entries the tier above still holds too (copied down ahead of their eviction: PrefixCache.copy_down_one):
        # fit() lets these go first, and without moving them down, since nothing is lost.
        self.held_above: set[bytes] = set()
        # Blocks of an entry whose copy down stopped between pieces (put's max_pieces: the idle copy, which yields to
        # requests), in the order stored: named by no snapshot yet; the next put of that entry skips them, fit() drops
        # them first (all of them: a store frees a batch of blocks with its last one).
        self.loose: dict[bytes, None] = {}
        self.mirror = None      # several ranks: parallel/mirror.SnapshotMirror; None on one device
        # Bumped whenever an entry or a block comes or goes: PrefixCache.copy_down_one's memo of a tier it found full.
        self.changes = 0

    # A tier whose entries take long to read (the disk: ~10 s for a 58K-token Flash-Next conversation on the H200
    # machine) is read on a thread of its own while the scheduler runs the other requests (PrefixCache.lookup).
    reads_in_background = False

    @property
    def name(self) -> str:
        return self.store.name

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

    def put(self, hashes: list[bytes], get_blocks: Callable[[list[int]], BlockData], key: bytes,
            snap: Snapshot, device_blocks: list[int] | None = None, max_pieces: int | None = None) -> bool:
        """Store a snapshot and whichever of its prefix blocks are missing, in batches of WRITE_PIECE blocks
        (get_blocks(indices) reads those blocks as rows).
        `device_blocks` names the device KV block of each hash when the entry comes down from the device (a
        snapshot of the device cache); None when it comes from the tier above. Other ranks copy their share
        from the same place. `max_pieces`: store at most that many pieces of missing blocks (`loose` until the
        entry is done) and stop → whether the entry is stored."""
        if key in self.snaps:
            self.snaps.move_to_end(key)
            return True
        missing = [i for i, h in enumerate(hashes) if h not in self.block_refs]
        # WRITE_PIECE blocks at a time: a batch read from the device is a gather into new device memory (1.5 GB for
        # a 58K-token Flash-Next conversation at once), and this runs when the KV pool is short
        for n, at in enumerate(range(0, len(missing), WRITE_PIECE)):
            if n == max_pieces:
                return False
            piece = missing[at: at + WRITE_PIECE]
            sizes = self.store.store_blocks([hashes[i] for i in piece], get_blocks(piece))
            for i, nbytes in zip(piece, sizes):
                h = hashes[i]
                if self.mirror is not None:
                    self.mirror.store_block(self, h, device_blocks[i] if device_blocks is not None else None)
                self.block_refs[h], self.block_bytes[h] = 0, nbytes
                self.bytes += nbytes
                self.loose[h] = None
            self.changes += 1
        for h in hashes:
            self.block_refs[h] += 1
            self.loose.pop(h, None)
        meta = SnapshotMeta(list(hashes), tuple(snap.tail), snap.num_tokens, 0)
        meta.nbytes = self.store.store_snapshot(key, (snap.state, snap.tail_kv), meta)
        if self.mirror is not None:
            self.mirror.store_snapshot(self, key, snap if device_blocks is not None else None)
        self._index(key, meta)
        self.fit()
        return True

    def _index(self, key: bytes, meta: SnapshotMeta) -> None:
        self.changes += 1
        self.snaps[key] = meta
        self.by_last_block.setdefault(meta.blocks[-1] if meta.blocks else ROOT_HASH, {})[meta.tail] = key
        self.bytes += meta.nbytes

    def load(self, key: bytes) -> tuple[list[BlockData], Snapshot] | None:
        """The blocks (as runs: TierStore.load_blocks) and snapshot of an entry, or None (with a warning) when it
        cannot be read back."""
        meta = self.snaps[key]
        try:
            payload = self.read(key, meta)
        except (CorruptEntry, OSError) as e:
            return self.unreadable(key, e)
        return self.loaded(key, meta, payload)

    def read(self, key: bytes, meta: SnapshotMeta) -> tuple[list[BlockData], SnapshotData]:
        """An entry's payloads from the store, the index untouched: what a background read runs on its own thread
        (PrefixCache.lookup, for a tier that `reads_in_background`). Raises CorruptEntry or OSError."""
        return self.store.load_blocks(meta.blocks), self.store.load_snapshot(key)

    def loaded(self, key: bytes, meta: SnapshotMeta, payload) -> tuple[list[BlockData], Snapshot]:
        """A read entry as (runs, Snapshot); it becomes the most recently used."""
        runs, (state, tail_kv) = payload
        if key in self.snaps:
            self.snaps.move_to_end(key)
        return runs, Snapshot(meta.num_tokens, meta.tail, state, tail_kv)

    @contextlib.contextmanager
    def protected(self, key: bytes):
        """The entry stays while inside (`installing`), however its copy up evicts; then the tier fits again."""
        self.installing.add(key)
        try:
            yield
        finally:
            self.installing.discard(key)
            self.fit()

    def touch(self, key: bytes) -> None:
        """The entry becomes the most recently used, here and in the store."""
        self.snaps.move_to_end(key)
        self.store.touch(key)

    def unreadable(self, key: bytes, error: Exception) -> None:
        log.warning("%s cache: ignoring entry %s: %s", self.name, key.hex(), error)
        if key in self.snaps:
            self.remove(key)
        return None

    @property
    def used_bytes(self) -> int:
        """What counts against the budget: the entries' bytes and the store's dead ones."""
        return self.bytes + self.store.dead_bytes

    def fit(self) -> None:
        """Evict least recently used entries (down a tier, when there is one) until used_bytes fit: first the loose
        blocks of an unfinished copy, then the entries the tier above holds too (dropped, not moved down), then the
        others."""
        if self.loose and self.used_bytes > self.capacity:
            self.drop_loose()
        while self.used_bytes > self.capacity:
            key = next((k for k in self.snaps if k in self.held_above and k not in self.installing),
                       None) if self.held_above else None
            if key is not None:
                self.remove(key)
                continue
            key = next((k for k in self.snaps if k not in self.installing), None)
            if key is None:
                return
            self.evict(key)

    def evict(self, key: bytes) -> None:
        meta = self.snaps[key]
        if self.lower is not None and key not in self.lower:
            entry = self.load(key)
            if entry is None:
                return
            runs, snap = entry
            self.lower.put(meta.blocks, lambda rows: batch_rows(runs, rows), key, snap)
        self.remove(key)

    def remove(self, key: bytes) -> None:
        """Forget an entry here, with the blocks no other entry names."""
        self.changes += 1
        meta = self.snaps.pop(key)
        self.held_above.discard(key)
        last = meta.blocks[-1] if meta.blocks else ROOT_HASH
        tails = self.by_last_block[last]
        del tails[meta.tail]
        if not tails:
            del self.by_last_block[last]
        self.bytes -= meta.nbytes
        self.store.drop_snapshot(key)
        if self.mirror is not None:
            self.mirror.drop_snapshot(self, key)
        for h in meta.blocks:
            self.block_refs[h] -= 1
            if self.block_refs[h] == 0:
                self._drop_unnamed(h)

    def _drop_unnamed(self, h: bytes) -> None:
        """Drop a block no entry names."""
        self.changes += 1
        del self.block_refs[h]
        self.bytes -= self.block_bytes.pop(h)
        self.store.drop_block(h)
        if self.mirror is not None:
            self.mirror.drop_block(self, h)

    def clear(self) -> None:
        """Forget every entry without moving it down, and the loose blocks."""
        while self.snaps:
            self.remove(next(iter(self.snaps)))
        self.drop_loose()

    def drop_loose(self) -> None:
        """Drop the blocks of an unfinished copy (`loose`)."""
        for h in self.loose:
            self._drop_unnamed(h)
        self.loose.clear()
