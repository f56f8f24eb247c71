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

from flashnext.cache.cache_entry import copy_tensors, read_block, write_block
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
        tier = cache.lower
        while tier is not None:
            self.levels[tier], tier.mirror = len(self.levels), self
            tier = tier.lower

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
        self.fetched: dict[bytes, object] = {}      # name → block or snapshot payload

    def apply(self, ops: list[int], kv, states) -> bool:
        """Replay rank 0's ops on this rank's pools and stores; False when a fetch failed here."""
        ok = True
        for i in range(0, len(ops), OP_FIELDS):
            kind, a, b, c, d = ops[i: i + OP_FIELDS]
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
            elif kind in (STORE_BLOCK, STORE_SNAPSHOT, DROP_BLOCK, DROP_SNAPSHOT):
                self._tier_op(kind, a, ints_name(b, c), d, kv)
            elif kind in (FETCH_SNAPSHOT, FETCH_BLOCK):
                ok = self._fetch(kind, self.stores[a], ints_name(b, c)) and ok
            elif kind == INSTALL_BLOCK:
                write_block(kv, d, self.fetched[ints_name(b, c)])
            else:   # INSTALL_SNAPSHOT: the last op of an install
                state, tail_kv = self.fetched[ints_name(b, c)]
                self.snaps[d] = (copy_tensors(state, kv.device),
                                 copy_tensors(tail_kv, kv.device) if tail_kv is not None else None)
                self.fetched.clear()
        return ok

    def _tier_op(self, kind: int, level: int, name: bytes, source: int, kv) -> None:
        store = self.stores[level]
        if kind == STORE_BLOCK:
            data = self.stores[level - 1].load_block(name) if source == FROM_ABOVE else read_block(kv, source)
            store.store_block(name, data)
        elif kind == STORE_SNAPSHOT:
            snap = self.stores[level - 1].load_snapshot(name) if source == FROM_ABOVE else self.snaps[source]
            store.store_snapshot(name, snap, None)
        elif kind == DROP_BLOCK:
            store.drop_block(name)
        else:
            store.drop_snapshot(name)

    def _fetch(self, kind: int, store: TierStore, name: bytes) -> bool:
        if kind == FETCH_SNAPSHOT:
            self.fetched.clear()
        try:
            self.fetched[name] = store.load_snapshot(name) if kind == FETCH_SNAPSHOT else store.load_block(name)
        except (CorruptEntry, OSError) as e:
            log.warning("%s cache: this rank cannot read its share of %s: %s", store.name, name.hex(), e)
            return False
        return True
