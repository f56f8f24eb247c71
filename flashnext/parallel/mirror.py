"""The prefix cache across ranks: every rank keeps its own share of each snapshot.

Rank 0's PrefixCache decides everything (what to snapshot, resume, evict); its snapshots hold rank 0's local
heads only. `SnapshotMirror` (rank 0) numbers each snapshot and logs what the cache did to it — taken from a
slot (with the slot's partial KV block), resumed into a slot (and a fresh block), dropped — and the next step's
broadcast carries the log (runtime.broadcast_step). `WorkerSnapshots` (ranks > 0) replays it on the rank's own
pools before that step's forward, in the same order, so each rank's snapshot equals what its shard of the
state was when rank 0 took its own. Only the device tier: host and disk tiers would need a store per rank.
"""
from __future__ import annotations

import torch

from flashnext.cache.cache_entry import read_block, write_block

TAKE, RESUME, DROP = 0, 1, 2
OP_FIELDS = 4          # kind, snapshot id, slot, KV block (-1: none)


class SnapshotMirror:
    def __init__(self):
        self.pending: list[tuple[int, int, int, int]] = []
        self._next = 0

    def take(self, snap, slot: int, tail_block: int) -> None:
        snap.mirror_id = self._next
        self._next += 1
        self.pending.append((TAKE, snap.mirror_id, slot, tail_block))

    def resume(self, snap, slot: int, block: int) -> None:
        self.pending.append((RESUME, snap.mirror_id, slot, block))

    def drop(self, snap) -> None:
        self.pending.append((DROP, snap.mirror_id, -1, -1))

    def flush(self) -> list[int]:
        """The pending ops, flattened, and forgotten here."""
        ops, self.pending = self.pending, []
        return [v for op in ops for v in op]


class WorkerSnapshots:
    def __init__(self):
        self.snaps: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]] = {}

    def apply(self, ops: list[int], kv, states) -> None:
        for i in range(0, len(ops), OP_FIELDS):
            kind, sid, slot, block = ops[i: i + OP_FIELDS]
            if kind == TAKE:
                tail_kv = {k: v.clone() for k, v in read_block(kv, block).items()} if block >= 0 else None
                self.snaps[sid] = (states.snapshot(slot), tail_kv)
            elif kind == RESUME:
                state, tail_kv = self.snaps[sid]
                states.restore(slot, state)
                if block >= 0:
                    write_block(kv, block, tail_kv)
            else:
                del self.snaps[sid]
