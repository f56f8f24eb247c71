"""Prefix cache for hybrid models: a block-granular trie over token ids whose nodes own KV blocks, with
snapshots of the recurrent state at chosen positions.

In a hybrid model a cached prefix is useless without the recurrent state at its end, so a request resumes
from the deepest *snapshot* on its prompt, not from the deepest matching block. Snapshots are taken at
--prefix-snapshot-interval boundaries during prefill (the scheduler cuts chunks there, so the state after
a chunk is the snapshot), at the end of every prompt, at the end of every finished reply, and when a
request is preempted.

Node at depth d ↔ the d-th full block of a prefix (its KV block is shared through KVPool refcounts with the
requests using it). A snapshot at position p = d·block_size + r hangs off the depth-d node under its r tail
tokens; when r > 0 the partial block's contents travel inside the snapshot and are copied into a fresh
block on resume (a sequence writes into its last block, so a partial block is never shared). A node
without any snapshot below it is useless and is pruned at once.

Device memory is LRU by bytes: snapshots under --prefix-cache-gb, KV blocks when the pool runs short
(the scheduler calls free_blocks before preempting). Over the snapshot budget, snapshots taken inside a prefill
that nothing has resumed from go first (oldest first), then the rest (ends of prompts and replies): a long
prompt takes one at each chunk end past an interval mark (8-64 for 65K tokens in chunks of 8K-1K; ~116 MB each
for Flash-Next), and under plain LRU eight 65K-token conversations pushed each other's ends out of the 1 GiB
default, so none came back warm (bench concurrency, H200, session 12). An evicted snapshot moves to the next
tier down (host RAM, then disk) with its prefix blocks — except one taken inside a prefill that nothing resumed from
and that no idle copy put there, which is dropped (`_evict`) —; a hit in a lower tier is copied back in before
resuming.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from flashnext.cache.cache_entry import (ROOT_HASH, Snapshot, batch_rows, block_hash, read_block, read_blocks,
                                         run_rows, snapshot_key, tensor_bytes, write_block, write_blocks)
from flashnext.cache.kv_pool import KVPool
from flashnext.cache.state_pool import StatePool
from flashnext.cache.tier_index import CorruptEntry, TierIndex

log = logging.getLogger("flashnext.cache")


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]                 # the block's tokens
    hash: bytes                          # chained hash of every token up to the block's end
    block: int                           # KV block id (one reference held by the cache)
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    snapshots: dict[tuple[int, ...], Snapshot] = field(default_factory=dict)
    pins: int = 0                        # kept while a lower-tier entry is being copied in below it

    def path(self) -> list[Node]:
        """The nodes from depth 1 down to this one."""
        out, node = [], self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


def _path_lists(node: Node) -> tuple[list[bytes], list[int]]:
    """The block hashes and device blocks of the path down to `node`."""
    path = node.path()
    return [n.hash for n in path], [n.block for n in path]


@dataclass(eq=False)
class _CopyAhead:
    """An entry copy_down_one has walked (begun, or waiting for room in the host tier): its path, fixed while the
    entry is on the device, and so far the pieces copied (0: not begun) and the host time spent (for the log)."""
    hashes: list[bytes]
    blocks: list[int]
    seconds: float = 0.0
    pieces: int = 0


# lookup's answer while the entry it found is being read from a slow tier: ask again at a later step.
LOADING = object()


@dataclass(eq=False)
class _BackgroundRead:
    tier: TierIndex
    meta: object                 # the entry's SnapshotMeta when the read started
    future: Future
    started: float               # perf_counter
    owners: set = field(default_factory=set)   # the requests waiting for it (PrefixCache.lookup's `owner`)
    # KVPool.releases when its install last failed: retried once a request gave blocks up (freeing them, or leaving
    # them to the cache's eviction; blocks are freed by releases alone)
    full_at: int | None = None


@dataclass
class PrefixHit:
    blocks: list[int]            # shared full blocks of the prefix
    snapshot: Snapshot

    @property
    def num_tokens(self) -> int:
        return self.snapshot.num_tokens


class PrefixCache:
    def __init__(self, kv: KVPool, states: StatePool, snapshot_budget_bytes: int, lower: TierIndex | None = None,
                 write_through: bool = False):
        self.kv = kv
        self.states = states
        self.block_size = kv.block_size
        self.block_bytes = tensor_bytes(read_block(kv, 0))   # a KV block's bytes in every pool tensor
        self.snapshot_budget = snapshot_budget_bytes
        self.lower = lower
        self.write_through = write_through
        self.root = Node((), ROOT_HASH, -1, None)
        self.lru: OrderedDict[bytes, tuple[Node, tuple[int, ...]]] = OrderedDict()
        self.inside_prefill: set[bytes] = set()   # snapshots taken inside a prefill that nothing resumed from yet
        self.snapshot_bytes = 0
        # prefix hits served from a lower tier, by its name: their tokens, and the host time of copying them in
        self.restored_tokens: Counter[str] = Counter()
        self.restore_seconds: Counter[str] = Counter()
        # Several ranks (flashnext/parallel/mirror.py): every snapshot taken, resumed or dropped here, and every
        # entry copied in from a lower tier, is also done by each rank on its own share; None on one device.
        self.mirror = None
        # Entries of a slow tier read on the reader thread, by snapshot key, and the key each waiting request
        # waits for (lookup, _read_in_background, forget_read)
        self._reads: dict[bytes, _BackgroundRead] = {}
        self._read_of: dict[object, bytes] = {}
        self._reader: ThreadPoolExecutor | None = None
        self._copies_ahead: dict[bytes, _CopyAhead] = {}   # entries copy_down_one walked and has not finished
        self.entries_changed = 0   # bumped whenever a device entry comes or goes (copy_down_one's memo)
        self._nothing_to_copy: tuple | None = None   # copy_down_one's state when it last found nothing to copy

    # ---- lookup and resume ----
    def lookup(self, tokens: list[int], limit: int, owner: str | None = None) -> PrefixHit | None | object:
        """The deepest snapshot of a prefix of tokens[:limit], copied in from a lower tier if deeper there.

        LOADING when that entry sits in a tier that reads in the background (the disk) and its read (started
        for `owner`, the id of the request asking; on one device — with several ranks every rank reads its share at once)
        has not finished: the scheduler admits other requests meanwhile and asks again once `waiting_for_read`
        says it is done. The read is kept until it is installed or every owner is forgotten (`forget_read`)."""
        found = self._match(tokens, limit)
        depth = found[0].snapshots[found[1]].num_tokens if found else 0
        for tier in self.tiers():
            entry = tier.match(tokens, limit, deeper_than=depth)
            if entry is None:
                continue
            key, meta = entry
            if tier.reads_in_background and self.mirror is None:
                read = self._read_in_background(tier, key, meta, owner)
                if read is LOADING:
                    return LOADING
                started, loaded = read
                installing = time.perf_counter()
                try:
                    installed = loaded is not None and self._install(tokens, meta.blocks, *loaded)
                except BaseException:
                    self._drop_read(key)
                    raise
                if installed or loaded is None:   # done with the read
                    self._drop_read(key)
                else:                             # the KV pool is full: kept, retried once blocks are freed
                    self._reads[key].full_at = self.kv.releases
            else:
                started = time.perf_counter()
                with tier.protected(key):
                    loaded = self._load_now(tier, key, entry)
                    installing = time.perf_counter()
                    installed = loaded is not None and self._install(tokens, meta.blocks, *loaded)
            if installed:
                done = time.perf_counter()
                seconds = done - started
                self.restored_tokens[tier.name] += meta.num_tokens
                self.restore_seconds[tier.name] += seconds
                # with the write-downs its room took (logged by _evict): what a resume spends before its first step;
                # the install (room made, blocks copied in) apart from the read (H200, session 21: one restore of
                # eight took 0.362 s against ~0.03 for the others, cause not known)
                log.info("%s tier: an entry of %d tokens restored in %.3f s (install %.3f s)", tier.name,
                         meta.num_tokens, seconds, done - installing)
                found = (installed, meta.tail)   # deeper than any snapshot the device had (`depth`)
                break
            if found is not None and loaded is not None:   # the failed install's evictions may have taken the hit
                found = self._match(tokens, limit)
                depth = found[0].snapshots[found[1]].num_tokens if found else 0
        if found is None:
            return None
        node, tail = found
        snap = node.snapshots[tail]
        key = snapshot_key(node.hash, tail)
        self.lru.move_to_end(key)
        self.inside_prefill.discard(key)
        return PrefixHit([n.block for n in node.path()], snap)

    def _load_now(self, tier: TierIndex, key: bytes, entry) -> tuple | None:
        """TierIndex.load, and with several ranks every rank's share fetched (else the entry is dropped)."""
        loaded = tier.load(key)
        if loaded is not None and self.mirror is not None and not self.mirror.fetch(tier, *entry):
            log.warning("%s cache: dropping entry %s: another rank cannot read its share", tier.name, key.hex())
            tier.remove(key)
            return None
        return loaded

    def _read_in_background(self, tier: TierIndex, key: bytes, meta, owner) -> object:
        """LOADING while the entry is read on the reader thread (started at the first ask; the entry stays in its
        tier meanwhile, `installing`, until the read is dropped); then (when it started, what TierIndex.load would
        have returned)."""
        if self._read_of.get(owner, key) != key:   # its deepest entry is another one now
            self.forget_read(owner)
        read = self._reads.get(key)
        if read is None:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="flashnext-tier-reader")
            tier.installing.add(key)
            read = self._reads[key] = _BackgroundRead(tier, meta, self._reader.submit(tier.read, key, meta),
                                                      time.perf_counter())
        if owner is not None:
            read.owners.add(owner)
            self._read_of[owner] = key
        if not read.future.done():
            return LOADING
        try:
            payload = read.future.result()
        except (CorruptEntry, OSError) as e:
            return read.started, tier.unreadable(key, e)
        if key not in tier:      # dropped while it was read: nothing to install
            return read.started, None
        return read.started, tier.loaded(key, read.meta, payload)

    def waiting_for_read(self, owner: object) -> bool:
        """Whether `owner`'s lookup would only find its background read not finished, or its install still without
        room (no KV block freed, none given up by a request to the cache's eviction, since it failed): no need to
        ask (a lookup hashes the whole prompt)."""
        read = self._reads.get(self._read_of.get(owner))
        return read is not None and (not read.future.done() or read.full_at == self.kv.releases)

    def forget_read(self, owner: object) -> None:
        """`owner` no longer waits (admitted, cancelled, finished): a read nobody waits for any more is let go."""
        key = self._read_of.pop(owner, None)
        read = self._reads.get(key) if key is not None else None
        if read is not None:
            read.owners.discard(owner)
            if not read.owners:
                self._drop_read(key)

    def _drop_read(self, key: bytes) -> None:
        """Forget a read (a running one finishes on the reader thread and its result is dropped) and let its entry
        be evicted again."""
        read = self._reads.pop(key)
        read.future.cancel()
        for owner in read.owners:
            if self._read_of.get(owner) == key:
                del self._read_of[owner]
        read.tier.installing.discard(key)
        read.tier.fit()

    def wait_for_reads(self, timeout: float) -> None:
        """Block until a background read finishes or `timeout` passes (the engine when only those are left)."""
        pending = [r.future for r in self._reads.values() if not r.future.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    @property
    def reading(self) -> bool:
        return bool(self._reads)

    @property
    def num_background_reads(self) -> int:
        return len(self._reads)

    def _match(self, tokens: list[int], limit: int) -> tuple[Node, tuple[int, ...]] | None:
        bs, node, depth, best = self.block_size, self.root, 0, None
        while True:
            for tail, snap in node.snapshots.items():
                n = depth * bs + len(tail)
                if n <= limit and tuple(tokens[depth * bs:n]) == tail and (best is None or n > best[2]):
                    best = (node, tail, n)
            if (depth + 1) * bs > limit:
                break
            node = node.children.get(tuple(tokens[depth * bs:(depth + 1) * bs]))
            if node is None:
                break
            depth += 1
        return None if best is None else best[:2]

    def resume(self, slot: int, blocks: list[int], hit: PrefixHit) -> None:
        """Fill a fresh slot and the sequence's first non-shared block (when the hit is not aligned)."""
        self.states.restore(slot, hit.snapshot.state)
        if hit.snapshot.tail_kv is not None:
            write_block(self.kv, blocks[len(hit.blocks)], hit.snapshot.tail_kv)
        if self.mirror is not None:
            self.mirror.resume(hit.snapshot, slot, blocks[len(hit.blocks)] if hit.snapshot.tail_kv is not None else -1)

    # ---- insertion ----
    def insert(self, tokens: list[int], blocks: list[int], slot: int, num_tokens: int, turn_end: bool = False,
               inside_prefill: bool = False) -> None:
        """Snapshot a running sequence whose first num_tokens tokens are computed (state of `slot`): at the end of
        a turn (a reply, or a history followed by a generation prompt: written through when asked), inside a
        prefill (the first over the budget to go), or at another end (a prompt's)."""
        if num_tokens <= 0:
            return
        bs = self.block_size
        d = num_tokens // bs
        node = self.root
        for i in range(d):
            key = tuple(tokens[i * bs:(i + 1) * bs])
            child = node.children.get(key)
            if child is None:
                self.kv.share([blocks[i]])
                child = node.children[key] = Node(key, block_hash(node.hash, key), blocks[i], node)
            node = child
        tail = tuple(tokens[d * bs:num_tokens])
        key = snapshot_key(node.hash, tail)
        snap = node.snapshots.get(tail)
        created = snap is None
        if created:
            tail_kv = {k: v.clone() for k, v in read_block(self.kv, blocks[d]).items()} if tail else None
            snap = Snapshot(num_tokens, tail, self.states.snapshot(slot), tail_kv)
            if self.mirror is not None:
                self.mirror.take(snap, slot, blocks[d] if tail else -1)
            node.snapshots[tail] = snap
            self.snapshot_bytes += snap.nbytes
        self.lru[key] = (node, tail)
        self.lru.move_to_end(key)
        self.entries_changed += created
        if not inside_prefill:
            self.inside_prefill.discard(key)   # an end now, whatever it was
        elif created:
            self.inside_prefill.add(key)
        if turn_end and self.write_through:
            for tier in self.tiers():
                self._write_down(tier, key, snap, *_path_lists(node))
        while self.snapshot_bytes > self.snapshot_budget and self.lru:
            self._evict(self._over_budget_victim())

    def _install(self, tokens: list[int], hashes: list[bytes], runs: list[dict], snap: Snapshot) -> Node | None:
        """Copy a lower-tier entry (the hashes of its full blocks, the blocks as runs: TierStore.load_blocks) into
        device blocks and the trie → the node its snapshot hangs off; None when the KV pool has no room."""
        bs, node, pinned = self.block_size, self.root, []
        n = sum(map(run_rows, runs))
        assert n == len(hashes)
        have = 0     # the entry's blocks the device holds already: a path from the root
        while have < n and (child := node.children.get(tuple(tokens[have * bs:(have + 1) * bs]))) is not None:
            child.pins += 1
            pinned.append(child)
            node = child
            have += 1
        # the rest are new nodes below: their blocks at once (a 58K-token entry has ~3,600); what the pool cannot
        # free leaves the entry short (ok False, the partial path pruned below)
        self.free_blocks(n - have)
        targets = self.kv.allocate(min(n - have, self.kv.num_free))
        ok = have + len(targets) == n
        rows = list(range(have, have + len(targets)))
        for i, block in zip(rows, targets):
            key = tuple(tokens[i * bs:(i + 1) * bs])
            child = node.children[key] = Node(key, hashes[i], block, node)
            if self.mirror is not None:
                self.mirror.install_block(child.hash, block)
            child.pins += 1
            pinned.append(child)
            node = child
        if rows:
            write_blocks(self.kv, targets, runs, rows)
        if ok:
            device_snap = snap.to(self.kv.device)
            snap_key = snapshot_key(node.hash, snap.tail)
            if self.mirror is not None:
                self.mirror.install_snapshot(snap_key, device_snap)
            node.snapshots[snap.tail] = device_snap
            self.snapshot_bytes += device_snap.nbytes
            self.lru[snap_key] = (node, snap.tail)
            self.entries_changed += 1
        for pinned_node in pinned:
            pinned_node.pins -= 1
        if pinned:
            self._prune(pinned[-1])
        while ok and self.snapshot_bytes > self.snapshot_budget and len(self.lru) > 1:
            self._evict(self._over_budget_victim(keep=snap_key))
        return node if ok else None

    def copy_down_one(self) -> bool:
        """Copy a piece (TierIndex.put's WRITE_PIECE blocks, or the snapshot after the last) of a device entry that
        the host tier lacks into it, the entry kept on the device too, when it fits there without evicting anything:
        False when there is none (or no host tier). Ends of prompts and replies first, then the snapshots taken
        inside a prefill (which their eviction would drop: `_evict`), least recently used first. Run while no
        request does (LLMEngine.idle_work) and between steps (LLMEngine's write-behind, its copy not waited for:
        host_copies.py), so that the eviction of such an entry, when a request needs its blocks, finds it written
        and costs no copy (on the H200 a 58K-token Flash-Next conversation's end took ~50 ms to write down on a
        resume's path, session 16). A piece at a time, so that a request arriving meanwhile waits for one piece
        (~0.1 GB), not a whole entry (~1.5 GB)."""
        host = self.lower
        if host is None or host.name != "host" or self.mirror is not None:
            return False
        # the write-behind asks at every decode step: once nothing fits (a full host tier), nothing is walked again
        # until the host tier or the device entries change
        state = (self.entries_changed, host.changes, host.capacity)
        if state == self._nothing_to_copy:
            return False
        room = host.capacity - host.used_bytes
        ends = [key for key in self.lru if key not in self.inside_prefill]
        for key in ends + [key for key in self.lru if key in self.inside_prefill]:
            if key in host:
                continue
            node, tail = self.lru[key]
            snap = node.snapshots[tail]
            if snap.nbytes > room:
                continue     # without its blocks already: no walk
            # the entry's path walked once, not at each of its ~15 pieces (3,600 nodes at 58K tokens: ~1 ms of host
            # time a walk, beside decode steps of ~6 ms); kept while the entry waits for room too
            copy = self._copies_ahead.get(key)
            if copy is None:
                copy = self._copies_ahead[key] = _CopyAhead(*_path_lists(node))
            size = sum(h not in host.block_refs for h in copy.hashes) * self.block_bytes + snap.nbytes
            if size > room:
                continue     # a smaller one may fit
            start = time.perf_counter()
            done = self._write_down(host, key, snap, copy.hashes, copy.blocks, max_pieces=1)
            copy.seconds += time.perf_counter() - start
            copy.pieces += 1
            if done:
                del self._copies_ahead[key]
                log.info("copied ahead: an entry of %d tokens down to the host tier in %d pieces, %.3f s of host time",
                         snap.num_tokens, copy.pieces, copy.seconds)
                host.held_above.add(key)
            return True
        self._nothing_to_copy = state
        return False

    def copying_down(self) -> bool:
        """Whether copies down to the host tier are still crossing (HostCopies.busy: not waited for)."""
        return self.lower is not None and self.lower.name == "host" and self.lower.store.copying()

    # ---- eviction ----
    def free_blocks(self, n: int) -> bool:
        """Evict least recently used snapshots until n KV blocks are free (or nothing is left)."""
        while self.kv.num_free < n and self.lru:
            self._evict(next(iter(self.lru)))
        return self.kv.num_free >= n

    def _over_budget_victim(self, keep: bytes | None = None) -> bytes:
        """The snapshot to drop over the snapshot budget: the oldest taken inside a prefill that nothing resumed
        from, else the oldest (never `keep`, an entry just copied in)."""
        oldest = None
        for key in self.lru:
            if key == keep:
                continue
            if key in self.inside_prefill:
                return key
            if oldest is None:
                oldest = key
        return oldest

    def _evict(self, key: bytes) -> None:
        # A snapshot taken inside a prefill that nothing resumed from is dropped, not written down (unless an idle
        # copy put it down already): on the H200's idle bench each such Flash-Next snapshot (its ~115 MB state, with
        # its blocks) cost 10–16 ms of a resume's queue time, seven for every 58K-token conversation the resume
        # evicted, whose end is what its next turn resumes from (the blocks go down with the end's snapshot). What
        # is lost: a later prompt that shares only part of this one's prefix (the same document, another question)
        # resumes from the lower tier at a shorter snapshot, or none. A snapshot once resumed from is an end.
        never_resumed = key in self.inside_prefill
        self.inside_prefill.discard(key)
        copy = self._copies_ahead.pop(key, None)
        if copy is not None and copy.pieces and never_resumed and self.lower is not None:
            self.lower.drop_loose()   # the blocks its unfinished idle copy put down, which nothing will name now
        node, tail = self.lru.pop(key)
        self.entries_changed += 1
        snap = node.snapshots.pop(tail)
        self.snapshot_bytes -= snap.nbytes
        if self.lower is not None and key not in self.lower and not never_resumed:
            start = time.perf_counter()
            self._write_down(self.lower, key, snap, *_path_lists(node))
            # on a request's path (making room for it): what an idle copy ahead of it saves
            log.info("evicted an entry of %d tokens: written down to the %s tier in %.3f s", snap.num_tokens,
                     self.lower.name, time.perf_counter() - start)
        elif self.lower is not None and key in self.lower:
            self.lower.touch(key)                   # as the write-down of an entry already there does
            self.lower.held_above.discard(key)      # a copy made ahead of this eviction is now the only one
        if self.mirror is not None:      # after the write-down, which the other ranks copy from their snapshot
            self.mirror.drop(snap)
        self._prune(node)

    def _write_down(self, tier: TierIndex, key: bytes, snap: Snapshot, hashes: list[bytes], blocks: list[int],
                    max_pieces: int | None = None) -> bool:
        """TierIndex.put of a device entry: its path's block hashes and device blocks (_path_lists)."""
        return tier.put(hashes, lambda rows: read_blocks(self.kv, [blocks[i] for i in rows]), key, snap, blocks,
                        max_pieces)

    def _prune(self, node: Node) -> None:
        while node.parent is not None and not node.snapshots and not node.children and not node.pins:
            del node.parent.children[node.key]
            self.kv.release([node.block])
            node = node.parent

    def evict_all(self) -> None:
        """Evict every device entry (down a tier, or dropped: `_evict`)."""
        while self.lru:
            self._evict(next(iter(self.lru)))

    def persist(self) -> int:
        """Copy the device and host entries that the disk tier lacks down to it (at shutdown: conversations then
        survive a restart even without --kv-host-write-through); returns how many were written.

        The most recently used entries that the disk's budget holds (`_newest_that_fit`) go down least recently
        used first, those already on disk touched before: the disk's own LRU eviction then lets go of its older
        files, not of the conversations in use when the server stopped, and no file is written only to be deleted
        again (a 40 GB host tier over a 16 GB disk budget wrote 136 entries at shutdown on the H200 to
        keep 57)."""
        tiers = self.tiers()
        if not tiers or tiers[-1].name != "disk":
            return 0
        disk, written = tiers[-1], 0
        # every entry held in memory, least recently used first: the host tier's are older than the device's (not the
        # snapshots inside a prefill on the device, which their eviction drops too, nor their copies ahead of it)
        entries = [(tier, key) for tier in tiers[:-1] for key in tier.snaps
                   if key not in self.inside_prefill or key not in tier.held_above] + [
            (None, key) for key in self.lru if key not in self.inside_prefill]
        chosen = self._newest_that_fit(entries, disk)
        for _, key in chosen:      # first, so that writing the others cannot evict them
            if key in disk:
                disk.touch(key)
        for tier, key in chosen:
            if key in disk:
                continue
            if tier is None:
                node, tail = self.lru[key]
                self._write_down(disk, key, node.snapshots[tail], *_path_lists(node))
                written += 1
            elif (entry := tier.load(key)) is not None:
                runs, snap = entry
                disk.put(tier.snaps[key].blocks, lambda rows, runs=runs: batch_rows(runs, rows), key, snap)
                written += 1
        disk.store.flush()   # the files are written in the background (cache/disk_tier.py): on disk before exit
        return written

    def _newest_that_fit(self, entries: list[tuple[TierIndex | None, bytes]], disk: TierIndex) -> list:
        """Of `entries` (least recently used first; a key held by two tiers counts at its newest place), the newest
        whose files the disk's budget holds, newest first and skipping any that would overflow it, each KV block
        counted once however many entries share it; returned least recently used first."""
        block = disk.store.stored_bytes(self.block_bytes)
        counted, keys, chosen, total = set(), set(), [], disk.store.dead_bytes   # dead rows count against it too
        for tier, key in reversed(entries):
            if key in keys:
                continue
            keys.add(key)
            if tier is None:
                node, tail = self.lru[key]
                snap = node.snapshots[tail]
                hashes, snapshot = [n.hash for n in node.path()], snap.nbytes
            else:
                hashes, snapshot = tier.snaps[key].blocks, tier.snaps[key].nbytes
            new = {h for h in hashes if h not in counted}
            size = len(new) * block + disk.store.stored_bytes(snapshot)
            if total + size > disk.capacity:
                continue
            total += size
            counted |= new
            chosen.append((tier, key))
        return chosen[::-1]

    def clear(self) -> None:
        """Drop every device and host entry (the disk tier keeps its files) and every background read."""
        for key in list(self._reads):
            self._drop_read(key)
        tiers, lower, self.lower = self.tiers(), self.lower, None
        self.evict_all()
        self.lower = lower
        for tier in tiers:
            if tier.name != "disk":
                tier.clear()

    @property
    def num_snapshots(self) -> int:
        return len(self.lru)

    def tiers(self) -> list[TierIndex]:
        """The lower tiers, top down (host, then disk)."""
        tiers, tier = [], self.lower
        while tier is not None:
            tiers.append(tier)
            tier = tier.lower
        return tiers
