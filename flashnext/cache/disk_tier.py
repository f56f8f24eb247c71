"""The disk tier of the prefix cache: conversations survive a restart.

Layout under --kv-disk-dir: `batches/<name>.safetensors` (KV blocks that came down together, as the host tier
keeps them: each tensor [rows, …], a row per block, the blocks' hashes in the header; a block is shared by every
snapshot whose prefix contains it) and `snapshots/<key>.safetensors` (state + partial block). Each file's
safetensors header carries the format version, the model identity (a hash of config.json, the weights index or
first shard header, dtype and block size) and a sha256 of its tensors. At start the batch and snapshot headers are
indexed; a foreign or unreadable file is skipped with a warning, and a payload whose checksum fails is never loaded
(its entry is dropped, the request is computed from scratch). A batch file is deleted with its last block; until
then its dropped rows stay on disk and count against the budget (`DiskStore.dead_bytes`, in TierIndex.used_bytes).

Why batches: with a file per block a 58K-token Flash-Next conversation was 3,625 files of 36 tensors, and reading
one back cost ~3 ms of CPU a file (open, read, parse, hash, 36 tensor views): 11 s on the dev machine from the page
cache or from disk alike, 9–13 s on the H200 host, longer than computing the conversation again (5.8 s); the disk
itself reads 1.8 GB/s there. A batch of up to WRITE_PIECE blocks is one file read, one hash and 36 views.

Files are written (and deleted) in the background, by one writer thread per store in the order they were
issued: the engine loop pays only for getting the payload into host memory (one copy per tensor of a batch of
blocks from the device, or nothing for the host tier's pinned tensors), not for splitting it into files, the
checksums and the disk. A load first waits for the
writes before it; so does a clean shutdown (`PrefixCache.persist`, a worker's stop), and interpreter exit
joins the thread. A write that fails (disk
full) is logged; its entry then fails to load like a damaged file: dropped, the request computed.

On several ranks each rank keeps its share of every entry under `<dir>/rank<r>/` (same layout), and the
identity also names the rank and the parallel layout, so files of another layout are ignored with a
warning. Only rank 0's snapshot headers carry the index (blocks, tail, position); an entry is indexed only
when every rank's share of it is there (the ranks share one host, so rank 0 can look).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashnext.cache.cache_entry import copy_tensors, tensor_bytes
from flashnext.cache.cache_file import UnreadableFile, read_cache_file, read_header, tensors_digest
from flashnext.cache.tier_index import (BlockData, CorruptEntry, SnapshotData, SnapshotMeta, TierIndex, TierStore,
                                        row_runs)
from flashnext.weights.shared_table import process_alive

log = logging.getLogger("flashnext.cache")

FORMAT = "flashnext-prefix-cache-v2"   # v1 kept a file per block
HEADER_BYTES = 1024   # what a file's safetensors header adds to its payload, about (the tier counts it)
HASH_BYTES = 36       # and what each block's hash adds to a batch file's header (16 bytes as JSON hex)
# Threads that read a conversation's batch files back: the reads and the hashing release the GIL.
READERS = min(8, (os.cpu_count() or 1) // 2)


def model_identity(model_path, dtype: torch.dtype, block_size: int) -> str:
    """Entries are only valid for the same weights, dtype and block layout."""
    path = Path(model_path)
    h = hashlib.sha256(FORMAT.encode())
    h.update((path / "config.json").read_bytes())
    index = path / "model.safetensors.index.json"
    shards = sorted(path.glob("*.safetensors"))
    if index.exists():
        h.update(index.read_bytes())
    if shards:
        with open(shards[0], "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(size, 1 << 24)))
    h.update(f"{dtype}|{block_size}".encode())
    return h.hexdigest()


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    # the buffers themselves: no copy
    return tensors_digest((name, t.contiguous().view(-1).view(torch.uint8).numpy()) for name, t in tensors.items())


@dataclass
class BatchFile:
    """A batch file's bookkeeping: its rows (blocks), those still stored, and the bytes a row takes on disk."""
    rows: int
    live: int
    row_bytes: int

    @property
    def dead_bytes(self) -> int:
        return (self.rows - self.live) * self.row_bytes


class DiskStore(TierStore):
    name = "disk"

    def __init__(self, directory, identity: str):
        self.dir = Path(directory)
        self.identity = identity
        self.batch_dir = self.dir / "batches"
        self.snapshot_dir = self.dir / "snapshots"
        self.batch_dir.mkdir(parents=True, exist_ok=True)
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="flashnext-disk-writer")
        self._last = None      # the writer's last task: first in first out, so when it is done all before are
        # threads reading a conversation's batch files back (they start on first use)
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="flashnext-disk-reader") if READERS > 1 else None
        self.rows: dict[bytes, tuple[str, int]] = {}   # block hash → (batch name, row)
        self.batches: dict[str, BatchFile] = {}
        self._index_batches()

    def _index_batches(self) -> None:
        """The batch files of ours already on disk (a restart; another rank's store that rank 0 checks)."""
        for path in sorted(self.batch_dir.glob("*.safetensors")):
            try:
                meta = read_header(path)
                if not self.ours(meta):
                    continue
                hashes = [bytes.fromhex(h) for h in json.loads(meta["blocks"])]
                size = path.stat().st_size
            except Exception as e:   # noqa: BLE001 - an unreadable header (or a file gone meanwhile): not ours to use
                log.warning("disk cache: ignoring unreadable %s: %s", path, e)
                continue
            batch = self.batches[path.stem] = BatchFile(len(hashes), 0, size // max(1, len(hashes)))
            for row, h in enumerate(hashes):
                if h not in self.rows:    # a block stored again after its first batch lost it: one of them
                    self.rows[h] = (path.stem, row)
                    batch.live += 1

    def stored_bytes(self, payload_bytes: int) -> int:
        """What a payload takes on disk as its own file (a snapshot); for a block, an upper bound (a batch file's
        header is shared by its rows: store_blocks)."""
        return payload_bytes + HEADER_BYTES

    def _submit(self, fn, *args, **kwargs) -> None:
        self._last = self._writer.submit(fn, *args, **kwargs)

    def flush(self) -> None:
        if self._last is not None:
            self._last.result()

    def batch_path(self, name: str) -> Path:
        return self.batch_dir / f"{name}.safetensors"

    def snapshot_path(self, key: bytes) -> Path:
        return self.snapshot_dir / f"{key.hex()}.safetensors"

    @property
    def dead_bytes(self) -> int:
        """Rows of batch files that no block needs any more, still on disk until their file goes (a batch is written
        and deleted whole): the tier counts them against its budget (TierIndex.used_bytes)."""
        return sum(batch.dead_bytes for batch in self.batches.values())

    def ours(self, meta: dict) -> bool:
        return meta.get("format") == FORMAT and meta.get("model") == self.identity

    def block_bytes(self, h: bytes) -> int:
        """What a stored block takes on disk (its batch file's size over its rows)."""
        return self.batches[self.rows[h][0]].row_bytes

    def missing(self, key: bytes, blocks: list[bytes]) -> str | None:
        """Why this store cannot serve an entry from its headers alone (None: it can). Rank 0 asks it of the other
        ranks' stores at start, before any rank writes."""
        path = self.snapshot_path(key)
        try:
            if not self.ours(read_header(path)):
                return f"{path} was written by another model, layout or format version"
        except Exception as e:   # noqa: BLE001 - a missing or unreadable header alike: not there to load
            return f"{path} is unreadable: {e}"
        absent = sum(h not in self.rows for h in blocks)
        return f"{absent} of its KV blocks are missing in {self.dir}" if absent else None

    def _write(self, path: Path, tensors: dict[str, torch.Tensor], extra: dict[str, str]) -> int:
        """Hand the file to the writer; returns its bytes as the tier counts them. The payload is a copy of its own
        in host memory when this returns: device blocks are reused at once, and so are the host tier's buffers once
        it drops an entry (cache/pinned_arena.py), while the writer may not have written them yet."""
        tensors = copy_tensors(tensors, "cpu")
        self._submit(self._write_file, path, tensors, extra)
        return self.stored_bytes(tensor_bytes(tensors))

    def _write_file(self, path: Path, tensors: dict[str, torch.Tensor], extra: dict[str, str]) -> None:
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            meta = {"format": FORMAT, "model": self.identity, "checksum": checksum(tensors), **extra}
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)
        except Exception as e:   # noqa: BLE001 - e.g. disk full: the entry will fail to load and be dropped
            log.warning("disk cache: could not write %s: %s", path, e)
            tmp.unlink(missing_ok=True)

    def _read(self, path: Path) -> dict[str, torch.Tensor]:
        self.flush()
        return self._read_written(path)

    def _read_written(self, path: Path) -> dict[str, torch.Tensor]:
        try:
            meta, tensors, digest = read_cache_file(path)
        except UnreadableFile as e:
            raise CorruptEntry(str(e)) from None
        if not self.ours(meta):
            raise CorruptEntry(f"{path} was written by another model, layout or format version")
        if meta.get("checksum") != digest:
            raise CorruptEntry(f"{path} fails its checksum")
        return tensors

    def store_blocks(self, hashes: list[bytes], batch: BlockData) -> list[int]:
        """One batch file: the batch comes to the host in one copy per tensor (see _write), the writer writes it.
        Its name is a hash of its blocks' hashes, so every rank names its share of a batch alike."""
        name = hashlib.sha256(b"".join(hashes)).hexdigest()[:32]
        for h in hashes:
            if h in self.rows:     # still indexed in an older file (a worker rank's view after a restart): superseded
                self.drop_block(h)
        extra = {"kind": "batch", "blocks": json.dumps([h.hex() for h in hashes])}
        nbytes = self._write(self.batch_path(name), batch, extra) + HASH_BYTES * len(hashes)
        self.batches[name] = BatchFile(len(hashes), len(hashes), nbytes // len(hashes))
        for row, h in enumerate(hashes):
            self.rows[h] = (name, row)
        return [nbytes // len(hashes)] * len(hashes)

    def load_blocks(self, hashes: list[bytes]) -> list[BlockData]:
        """The blocks as runs of consecutive rows of one batch; each batch file read once, by the reader threads."""
        self.flush()
        absent = next((h for h in hashes if h not in self.rows), None)
        if absent is not None:
            raise CorruptEntry(f"KV block {absent.hex()} is not in {self.batch_dir}")
        runs = row_runs([self.rows[h] for h in hashes])
        names = list(dict.fromkeys(name for name, _, _ in runs))
        paths = [self.batch_path(name) for name in names]
        if self._readers is not None and len(paths) > 1:
            files = dict(zip(names, self._readers.map(self._read_written, paths)))
        else:
            files = {name: self._read_written(path) for name, path in zip(names, paths)}
        for name, tensors in files.items():
            if any(t.shape[0] != self.batches[name].rows for t in tensors.values()):
                raise CorruptEntry(f"{self.batch_path(name)} holds another number of blocks than its header names")
        return [{key: t[first: first + n] for key, t in files[name].items()} for name, first, n in runs]

    def drop_block(self, h: bytes) -> None:
        """Forget a block; its batch file goes with its last block (after the writes queued before)."""
        name, _ = self.rows.pop(h)
        batch = self.batches[name]
        batch.live -= 1
        if batch.live == 0:
            self._delete_batch(name)

    def _delete_batch(self, name: str) -> None:
        del self.batches[name]
        self._submit(self.batch_path(name).unlink, missing_ok=True)

    def keep_only(self, blocks) -> int:
        """Drop every stored block not in `blocks` (a restart's index: what no entry needs), and the batch files
        left holding none (also those whose every block another file holds) → how many files go."""
        before = len(self.batches)
        for h in [h for h in self.rows if h not in blocks]:
            self.drop_block(h)
        for name in [name for name, batch in self.batches.items() if batch.live == 0]:
            self._delete_batch(name)
        return before - len(self.batches)

    def store_snapshot(self, key: bytes, snap: SnapshotData, meta: SnapshotMeta | None) -> int:
        state, tail_kv = snap
        tensors = {f"state.{k}": v for k, v in state.items()}
        tensors.update({f"tail.{k}": v for k, v in (tail_kv or {}).items()})
        extra = {"kind": "snapshot"}
        if meta is not None:
            extra.update(blocks=json.dumps([h.hex() for h in meta.blocks]), tail=json.dumps(list(meta.tail)),
                         num_tokens=str(meta.num_tokens))
        return self._write(self.snapshot_path(key), tensors, extra)

    def load_snapshot(self, key: bytes) -> SnapshotData:
        path = self.snapshot_path(key)
        tensors = self._read(path)
        state = {k[len("state."):]: v for k, v in tensors.items() if k.startswith("state.")}
        tail_kv = {k[len("tail."):]: v for k, v in tensors.items() if k.startswith("tail.")} or None
        os.utime(path)   # LRU order survives a restart
        return state, tail_kv

    def touch(self, key: bytes) -> None:
        self._submit(_touch_file, self.snapshot_path(key))   # after a pending write of it

    def drop_snapshot(self, key: bytes) -> None:
        self._submit(self.snapshot_path(key).unlink, missing_ok=True)


def _touch_file(path: Path) -> None:
    try:
        os.utime(path)
    except OSError as e:   # gone (dropped meanwhile): nothing to order
        log.debug("disk cache: could not touch %s: %s", path, e)


def disk_stores(directory, identity: str, tp: int = 1, ep: int = 1) -> list[DiskStore]:
    """Every rank's store, by rank: the directory itself on one process; `rank<r>/` under it on several."""
    world = max(tp, ep)
    if world == 1:
        return [DiskStore(directory, identity)]
    layout = f"{identity}|world {world} tensor parallel {tp} expert parallel {ep}"
    return [DiskStore(Path(directory) / f"rank{r}", hashlib.sha256(f"{layout}|rank {r}".encode()).hexdigest())
            for r in range(world)]


class DiskTier(TierIndex):
    reads_in_background = True
    def __init__(self, store: DiskStore, capacity_bytes: int, block_size: int, peers: list[DiskStore] = ()):
        super().__init__(store, capacity_bytes, block_size, None)
        self.peers = list(peers)      # the other ranks' stores: an entry counts only when all of them hold it
        self._scan()

    def _scan(self) -> None:
        store = self.store
        paths = sorted(store.snapshot_dir.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        for path in paths:
            try:
                meta = read_header(path)
                key = bytes.fromhex(path.stem)
                if not store.ours(meta):
                    log.warning("disk cache: ignoring %s: written by another model, layout or format version", path)
                    continue
                blocks = [bytes.fromhex(h) for h in json.loads(meta["blocks"])]
                missing = [h for h in blocks if h not in store.rows]
                if missing:
                    log.warning("disk cache: ignoring %s: %d of its KV blocks are missing", path, len(missing))
                    continue
                tail, num_tokens = tuple(json.loads(meta["tail"])), int(meta["num_tokens"])
            except Exception as e:   # noqa: BLE001 - any unreadable header means: not ours to load
                log.warning("disk cache: ignoring unreadable %s: %s", path, e)
                continue
            why = [w for w in (peer.missing(key, blocks) for peer in self.peers) if w]
            if why:
                log.warning("disk cache: ignoring %s: another rank's share is not there (%s)", path, why[0])
                continue
            for h in blocks:
                if h not in self.block_refs:
                    self.block_refs[h], self.block_bytes[h] = 0, store.block_bytes(h)
                    self.bytes += self.block_bytes[h]
                self.block_refs[h] += 1
            self._index(key, SnapshotMeta(blocks, tail, num_tokens, path.stat().st_size))
        if self.snaps:
            log.info("disk cache: %d snapshots (%.2f GiB) in %s", len(self.snaps), self.bytes / (1 << 30), store.dir)
        deleted = self.store.keep_only(self.block_refs)   # rows no entry names are dead: they count in fit
        self.fit()
        self._collect(deleted)

    def _collect(self, removed: int) -> None:
        """Delete the files of ours that no indexed entry needs, in this store and the other ranks': batches none of
        whose blocks an entry names (a crash between the writes, a snapshot deleted by hand, entries dropped to fit
        --kv-disk-gb), snapshots the index dropped, and temporary files of interrupted writes. Otherwise they
        would fill the disk past --kv-disk-gb, since only indexed entries are counted. Files of another model or
        layout stay (their own server may use them). `removed`: files deleted already (logged with these)."""
        self.store.flush()   # the deletions of the entries _fit dropped
        for store in [self.store, *self.peers]:
            for path in [*store.batch_dir.glob("*.tmp*"), *store.snapshot_dir.glob("*.tmp*")]:
                pid = path.suffix[len(".tmp"):]
                if pid.isdigit() and not process_alive(int(pid)):   # a write its process did not finish
                    path.unlink(missing_ok=True)
                    removed += 1
            if store is not self.store:   # this store's dead rows went before the fit (_scan)
                removed += store.keep_only(self.block_refs)
            store.flush()
            for path in store.snapshot_dir.glob("*.safetensors"):
                try:
                    if bytes.fromhex(path.stem) in self.snaps or not store.ours(read_header(path)):
                        continue
                except Exception:   # noqa: BLE001 - a name or header that is not ours: not ours to delete
                    continue
                path.unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("disk cache: deleted %d files that no cached conversation needs", removed)
