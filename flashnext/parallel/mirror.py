"""The prefix cache across ranks: every rank keeps its own share of each snapshot and tier entry.

Rank 0's PrefixCache and its lower tiers decide everything (what to snapshot, resume, evict, write down to
host RAM or disk, copy back in); their payloads are rank 0's local heads only. `SnapshotMirror` (rank 0) logs
each move of data the cache makes, and `WorkerCache` (ranks > 0) replays the log in the same order on the
rank's own pools and stores (a dict of host tensors, a `rank<r>/` directory under --kv-disk-dir), so each
rank holds its own share of whatever rank 0 holds, under the same names:
- device snapshots: taken from a slot (with the slot's partial KV block), resumed into a slot (and a fresh
  block), dropped; numbered by the mirror;
- lower tiers: a block or snapshot stored (from a device block or snapshot, or from the tier above), dropped;
  named by their hashes, split into two ints each (the step message is an int tensor) rather than numbered,
  so a rank's files keep the names rank 0's have and a restart finds them again;
- copying an entry back in: fetched from a tier, its blocks written into the device blocks rank 0 chose, its
  snapshot numbered like a taken one.
The log rides on the next step's broadcast (runtime.broadcast_step): a rank's pools change only through
forwards and these ops, so replaying them in order before that step's forward reads what rank 0 read.
The fetch is the one move a rank can fail on its own (its file damaged or gone), so it is not left to the
next step: `fetch` has every rank read its share at once and answer (runtime.send_ops); an entry some rank
cannot read is dropped on every rank, and the install that follows uses what was read.
"""
from __future__ import annotations

import logging
from typing import Callable

from flashnext.cache.cache_entry import (WRITE_PIECE, batch_rows, copy_tensors, read_block, read_blocks, write_block,
                                         write_blocks)
from flashnext.cache.tier_index import CorruptEntry, SnapshotData, SnapshotMeta, TierIndex, TierStore

log = logging.getLogger("flashnext.parallel")

(TAKE, RESUME, DROP, STORE_BLOCK, STORE_SNAPSHOT, DROP_BLOCK, DROP_SNAPSHOT, FETCH_SNAPSHOT, FETCH_BLOCK,
 INSTALL_BLOCK, INSTALL_SNAPSHOT) = range(11)
OP_FIELDS = 5          # kind, then (snapshot id, slot, KV block) or (tier, name as two ints, source / target)
FROM_ABOVE = -1        # a tier's store op that copies from the tier above it instead of from the device


def name_ints(name: bytes) -> tuple[int, int]:
    return int.from_bytes(name[:8], "little", signed=True), int.from_bytes(name[8:], "little", signed=True)


def ints_name(a: int, b: int) -> bytes:
    return a.to_bytes(8, "little", signed=True) + b.to_bytes(8, "little", signed=True)


class SnapshotMirror:
    def __init__(self, send: Callable[[list[int], object, object], bool]):
        self.send = send            # runtime.send_ops: every rank replays these ops on (kv, states) now
        self.pending: list[tuple[int, ...]] = []
        self.cache = None
        self.levels: dict[TierIndex, int] = {}     # each lower tier by its place under the device
        self._next = 0

    def attach(self, cache) -> None:
        """Log what `cache` (rank 0's PrefixCache) and each of its lower tiers do."""
        self.cache, cache.mirror = cache, self
        for tier in cache.tiers():
            self.levels[tier], tier.mirror = len(self.levels), self

    def _new_id(self, snap) -> int:
        snap.mirror_id = self._next
        self._next += 1
        return snap.mirror_id

    # ---- device snapshots ----
    def take(self, snap, slot: int, tail_block: int) -> None:
        self.pending.append((TAKE, self._new_id(snap), slot, tail_block, 0))

    def resume(self, snap, slot: int, block: int) -> None:
        self.pending.append((RESUME, snap.mirror_id, slot, block, 0))

    def drop(self, snap) -> None:
        self.pending.append((DROP, snap.mirror_id, 0, 0, 0))

    # ---- lower tiers ----
    def store_block(self, tier: TierIndex, h: bytes, device_block: int | None) -> None:
        source = FROM_ABOVE if device_block is None else device_block
        self.pending.append((STORE_BLOCK, self.levels[tier], *name_ints(h), source))

    def store_snapshot(self, tier: TierIndex, key: bytes, device_snap) -> None:
        source = FROM_ABOVE if device_snap is None else device_snap.mirror_id
        self.pending.append((STORE_SNAPSHOT, self.levels[tier], *name_ints(key), source))

    def drop_block(self, tier: TierIndex, h: bytes) -> None:
        self.pending.append((DROP_BLOCK, self.levels[tier], *name_ints(h), 0))

    def drop_snapshot(self, tier: TierIndex, key: bytes) -> None:
        self.pending.append((DROP_SNAPSHOT, self.levels[tier], *name_ints(key), 0))

    def fetch(self, tier: TierIndex, key: bytes, meta: SnapshotMeta) -> bool:
        """Every rank reads its share of a tier entry now, for the install that follows; False when one cannot."""
        level = self.levels[tier]
        self.pending.append((FETCH_SNAPSHOT, level, *name_ints(key), 0))
        self.pending += [(FETCH_BLOCK, level, *name_ints(h), 0) for h in meta.blocks]
        return self.sync()

    def install_block(self, h: bytes, block: int) -> None:
        self.pending.append((INSTALL_BLOCK, 0, *name_ints(h), block))

    def install_snapshot(self, key: bytes, device_snap) -> None:
        self.pending.append((INSTALL_SNAPSHOT, 0, *name_ints(key), self._new_id(device_snap)))

    # ---- sending ----
    def flush(self) -> list[int]:
        """The pending ops, flattened, and forgotten here."""
        ops, self.pending = self.pending, []
        return [v for op in ops for v in op]

    def sync(self) -> bool:
        """Every rank replays the pending ops now (a fetch, or the last ops before the workers stop)."""
        if not self.pending:
            return True
        return self.send(self.flush(), self.cache.kv, self.cache.states)


class WorkerCache:
    """A worker rank's share of the prefix cache: device snapshots by mirror id, its own store of each lower
    tier (in rank 0's order, host above disk), and the entry last fetched from one of them."""

    def __init__(self, stores: list[TierStore] = ()):
        self.stores = list(stores)
        self.snaps: dict[int, SnapshotData] = {}
        self.fetched: dict[bytes, SnapshotData] = {}              # name → snapshot payload
        self.fetched_blocks: tuple[list, dict[bytes, int]] = ([], {})  # runs (load_blocks), row of each name

    def flush(self) -> None:
        """Before the rank stops: what its stores write in the background is written."""
        for store in self.stores:
            store.flush()

    def apply(self, ops: list[int], kv, states) -> bool:
        """Replay rank 0's ops on this rank's pools and stores; False when a fetch failed here. Consecutive block
        ops of one kind (a conversation's blocks stored, fetched or installed) run as one batch, as rank 0's do."""
        ok = True
        ops = [ops[i: i + OP_FIELDS] for i in range(0, len(ops), OP_FIELDS)]
        i = 0
        while i < len(ops):
            kind, a, b, c, d = ops[i]
            if kind in (STORE_BLOCK, FETCH_BLOCK, INSTALL_BLOCK):
                j = i + 1
                while j < len(ops) and _same_batch(ops[i], ops[j]):
                    j += 1
                ok = self._blocks(ops[i:j], kv) and ok
                i = j
                continue
            i += 1
            if kind == TAKE:
                tail_kv = {k: v.clone() for k, v in read_block(kv, c).items()} if c >= 0 else None
                self.snaps[a] = (states.snapshot(b), tail_kv)
            elif kind == RESUME:
                state, tail_kv = self.snaps[a]
                states.restore(b, state)
                if c >= 0:
                    write_block(kv, c, tail_kv)
            elif kind == DROP:
                del self.snaps[a]
            elif kind in (STORE_SNAPSHOT, DROP_BLOCK, DROP_SNAPSHOT):
                self._tier_op(kind, a, ints_name(b, c), d)
            elif kind == FETCH_SNAPSHOT:
                ok = self._fetch_snapshot(self.stores[a], ints_name(b, c)) and ok
            else:   # INSTALL_SNAPSHOT: the last op of an install
                state, tail_kv = self.fetched[ints_name(b, c)]
                self.snaps[d] = (copy_tensors(state, kv.device),
                                 copy_tensors(tail_kv, kv.device) if tail_kv is not None else None)
                self.fetched.clear()
                self.fetched_blocks = ([], {})
        return ok

    def _blocks(self, ops: list[list[int]], kv) -> bool:
        """One batch of STORE_BLOCK, FETCH_BLOCK or INSTALL_BLOCK ops (see _same_batch)."""
        kind, level = ops[0][0], ops[0][1]
        names = [ints_name(b, c) for _, _, b, c, _ in ops]
        if kind == STORE_BLOCK:   # in rank 0's pieces of WRITE_PIECE blocks (TierIndex.put)
            for at in range(0, len(ops), WRITE_PIECE):
                piece, piece_names = ops[at: at + WRITE_PIECE], names[at: at + WRITE_PIECE]
                if piece[0][4] == FROM_ABOVE:
                    data = batch_rows(self.stores[level - 1].load_blocks(piece_names), list(range(len(piece))))
                else:
                    data = read_blocks(kv, [d for *_, d in piece])
                self.stores[level].store_blocks(piece_names, data)
            return True
        if kind == FETCH_BLOCK:
            store = self.stores[level]
            try:
                self.fetched_blocks = (store.load_blocks(names), {name: row for row, name in enumerate(names)})
            except (CorruptEntry, OSError) as e:
                log.warning("%s cache: this rank cannot read its share of %s: %s", store.name, names[0].hex(), e)
                return False
            return True
        runs, row_of = self.fetched_blocks     # INSTALL_BLOCK
        write_blocks(kv, [d for *_, d in ops], runs, [row_of[name] for name in names])
        return True

    def _tier_op(self, kind: int, level: int, name: bytes, source: int) -> None:
        store = self.stores[level]
        if kind == STORE_SNAPSHOT:
            snap = self.stores[level - 1].load_snapshot(name) if source == FROM_ABOVE else self.snaps[source]
            store.store_snapshot(name, snap, None)
        elif kind == DROP_BLOCK:
            store.drop_block(name)
        else:
            store.drop_snapshot(name)

    def _fetch_snapshot(self, store: TierStore, name: bytes) -> bool:
        self.fetched.clear()
        try:
            self.fetched[name] = store.load_snapshot(name)
        except (CorruptEntry, OSError) as e:
            log.warning("%s cache: this rank cannot read its share of %s: %s", store.name, name.hex(), e)
            return False
        return True


def _same_batch(first: list[int], op: list[int]) -> bool:
    """Block ops that run as one batch: same kind, same tier, and (stores) copying from the same place."""
    if op[0] != first[0] or op[1] != first[1]:
        return False
    return first[0] != STORE_BLOCK or (op[4] == FROM_ABOVE) == (first[4] == FROM_ABOVE)
