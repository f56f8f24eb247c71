"""The disk tier's store writes in the background (flashnext/cache/disk_tier.py): the checksum and the file
write run on its writer thread, not the caller's; a load or flush() sees everything issued before it; deletes keep
their order after writes; a failed write loses only its entry."""
import logging
import threading

import pytest
import torch

from flashnext.cache import disk_tier
from flashnext.cache.disk_tier import HASH_BYTES, HEADER_BYTES, DiskStore
from flashnext.cache.tier_index import SnapshotMeta


def store_one(store, h, block):
    """One block stored as a batch of one → the bytes it takes."""
    return store.store_blocks([h], {name: t[None] for name, t in block.items()})[0]


def load_one(store, h):
    return {name: t[0] for name, t in store.load_blocks([h])[0].items()}


def _dead_pid() -> int:
    """The pid of a process that has exited (an interrupted write's temporary file names its writer)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _block(seed):
    g = torch.Generator().manual_seed(seed)
    return {"k.3": torch.randn(16, 2, 8, generator=g), "v.3": torch.randn(16, 2, 8, generator=g)}


def _snapshot(seed):
    g = torch.Generator().manual_seed(seed)
    return {"conv.0": torch.randn(4, 6, generator=g), "ssm.0": torch.randn(2, 8, 8, generator=g)}, _block(seed + 1)


def test_writes_run_on_the_writer_thread_and_loads_see_them(tmp_path, monkeypatch):
    threads = []
    original = disk_tier.checksum
    monkeypatch.setattr(disk_tier, "checksum", lambda t: threads.append(threading.current_thread().name) or original(t))
    store = DiskStore(tmp_path, "model-a")
    block, snap = _block(0), _snapshot(1)
    size = store_one(store, b"\x01" * 8, block)
    assert size == sum(t.numel() * t.element_size() for t in block.values()) + HEADER_BYTES + HASH_BYTES
    store.store_snapshot(b"\x02" * 8, snap, SnapshotMeta([b"\x01" * 8], (5, 6), 18, 0))
    # a load right away waits for the writes before it, and checks them (cache_file hashes the bytes it read)
    got = load_one(store, b"\x01" * 8)
    assert all(torch.equal(got[k], block[k]) for k in block)
    state, tail = store.load_snapshot(b"\x02" * 8)
    assert all(torch.equal(state[k], snap[0][k]) for k in snap[0]) and all(torch.equal(tail[k], snap[1][k])
                                                                           for k in snap[1])
    assert len(threads) == 2 and all(name.startswith("flashnext-disk-writer") for name in threads), threads
    assert store.missing(b"\x02" * 8, [b"\x01" * 8]) is None


def test_a_block_dropped_and_stored_again_survives_the_queued_delete(tmp_path):
    """The writer is busy; a block's deletion waits in its queue when the block is stored again: the store must
    not be skipped (the file still exists now) and then lost to the delete."""
    store = DiskStore(tmp_path, "model-a")
    h, block = b"\x04" * 8, _block(4)
    store_one(store, h, block)
    store.flush()
    busy = threading.Event()
    store._submit(busy.wait)
    store.drop_block(h)
    store_one(store, h, block)
    busy.set()
    store.flush()
    got = load_one(store, h)
    assert all(torch.equal(got[k], block[k]) for k in block)


def test_drops_follow_writes_in_order(tmp_path):
    store = DiskStore(tmp_path, "model-a")
    for i in range(20):
        store_one(store, bytes([i]) * 8, _block(i))
    for i in range(0, 20, 2):
        store.drop_block(bytes([i]) * 8)
    store.flush()
    assert len(list((tmp_path / "batches").iterdir())) == 10
    assert set(DiskStore(tmp_path, "model-a").rows) == {bytes([i]) * 8 for i in range(1, 20, 2)}   # from the headers


def test_a_failed_write_is_logged_and_its_entry_fails_to_load(tmp_path, monkeypatch, caplog):
    store = DiskStore(tmp_path, "model-a")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_tier, "save_file", full_disk)
    with caplog.at_level(logging.WARNING, logger="flashnext.cache"):
        store_one(store, b"\x03" * 8, _block(3))
        store.flush()
    assert "could not write" in caplog.text and "No space left" in caplog.text
    with pytest.raises(OSError):          # TierIndex.load drops such an entry and the request is computed
        load_one(store, b"\x03" * 8)
    assert not list((tmp_path / "batches").iterdir())


def _entry(tier, hashes, key, seed):
    """Put an entry of len(hashes) blocks into `tier`."""
    from flashnext.cache.cache_entry import Snapshot

    blocks = [_block(seed + i) for i in range(len(hashes))]
    state, _ = _snapshot(seed)
    tier.put(hashes, lambda rows: {k: torch.stack([blocks[r][k] for r in rows]) for k in blocks[0]}, key,
             Snapshot(16 * len(hashes) + 2, (7, 9), state, None))


def test_restart_deletes_what_no_entry_needs_and_keeps_foreign_files(tmp_path, caplog):
    """Blocks of a snapshot deleted by hand, a snapshot without its blocks, a temporary file of an interrupted
    write and an entry dropped to fit the budget: gone after a restart (they are not counted in --kv-disk-gb,
    so they would fill the disk); another model's files stay."""
    from flashnext.cache.disk_tier import DiskTier

    store = DiskStore(tmp_path, "model-a")
    tier = DiskTier(store, 1 << 30, 16)
    a, b, c = [bytes([i]) * 16 for i in (1, 2, 3)]
    _entry(tier, [a, b], b"\xaa" * 16, 0)         # kept
    _entry(tier, [a, c], b"\xbb" * 16, 10)        # its snapshot file will be deleted by hand: c is orphaned
    _entry(tier, [bytes([4]) * 16], b"\xcc" * 16, 20)   # its batch file will be deleted: the snapshot is useless
    foreign = DiskStore(tmp_path, "model-b")
    store_one(foreign, bytes([5]) * 16, _block(5))
    foreign.flush()
    store.flush()
    store.snapshot_path(b"\xbb" * 16).unlink()
    store.batch_path(store.rows[bytes([4]) * 16][0]).unlink()
    (store.batch_dir / f"0f.safetensors.tmp{_dead_pid()}").write_bytes(b"partial")
    with caplog.at_level(logging.INFO, logger="flashnext.cache"):
        again = DiskTier(DiskStore(tmp_path, "model-a"), 1 << 30, 16)
    assert list(again.snaps) == [b"\xaa" * 16]
    assert set(DiskStore(tmp_path, "model-a").rows) == {a, b}           # c's batch file is gone
    assert set(DiskStore(tmp_path, "model-b").rows) == {bytes([5]) * 16}
    assert len(list(store.batch_dir.iterdir())) == 2                     # a + b in one, the foreign one
    assert sorted(p.name for p in store.snapshot_dir.iterdir()) == [f"{'aa' * 16}.safetensors"]
    assert "deleted 3 files that no cached conversation needs" in caplog.text   # c's batch, cc's snapshot, tmp
    # a budget that holds nothing: the entry is dropped at the scan, and its files with it
    DiskTier(DiskStore(tmp_path, "model-a"), 1, 16)
    assert [p.name for p in store.batch_dir.iterdir()] == [foreign.batch_path(foreign.rows[bytes([5]) * 16][0]).name]


def test_cache_file_reader_equals_safetensors(tmp_path):
    """The one-read parser gives safetensors' tensors and disk_tier.checksum's digest, for every dtype the tiers
    store and an empty tensor; a damaged header or a tensor past the end of the file is refused."""
    from safetensors.torch import load_file, save_file

    from flashnext.cache.cache_file import UnreadableFile, read_cache_file
    from flashnext.cache.disk_tier import checksum

    g = torch.Generator().manual_seed(0)
    tensors = {"k.3": torch.randn(16, 2, 8, generator=g).bfloat16(), "state.ssm": torch.randn(3, 5, generator=g),
               "conv": torch.randn(4, generator=g).half(), "ids": torch.arange(7), "empty": torch.zeros(0, 4),
               "keys": torch.randn(16, 4, generator=g).to(torch.float8_e4m3fn)}
    path = tmp_path / "f.safetensors"
    save_file(tensors, str(path), metadata={"checksum": "x", "kind": "block"})
    meta, got, digest = read_cache_file(path)
    want = load_file(str(path))
    assert meta == {"checksum": "x", "kind": "block"} and got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
               for k in want)
    assert digest == checksum(want)
    data = bytearray(path.read_bytes())
    (tmp_path / "header").write_bytes(data[:8] + b"{nonsense" + data[17:])
    with pytest.raises(UnreadableFile, match="damaged header"):
        read_cache_file(tmp_path / "header")
    (tmp_path / "short").write_bytes(data[:-64])
    with pytest.raises(UnreadableFile, match="outside the file"):
        read_cache_file(tmp_path / "short")


def test_a_batch_of_blocks_is_one_file_and_batches_come_back_through_the_readers(tmp_path, monkeypatch):
    """The engine hands a batch (rows = blocks) over in one piece; the writer thread writes it as one file; a
    conversation's blocks come back as runs of rows, each batch file read once by a reader thread, in order."""
    monkeypatch.setattr(disk_tier, "READERS", 4)
    threads = []
    original = disk_tier.checksum
    monkeypatch.setattr(disk_tier, "checksum", lambda t: threads.append(threading.current_thread().name) or original(t))
    store = DiskStore(tmp_path, "model-a")
    submitted, readers = [], []
    submit, read = store._submit, store._read_written
    store._submit = lambda fn, *a, **k: submitted.append(fn.__name__) or submit(fn, *a, **k)
    store._read_written = lambda path: readers.append(threading.current_thread().name) or read(path)
    blocks = [_block(i) for i in range(7)]
    hashes = [bytes([i]) * 8 for i in range(7)]
    stack = lambda rows: {name: torch.stack([blocks[r][name] for r in rows]) for name in blocks[0]}  # noqa: E731
    sizes = store.store_blocks(hashes[:5], stack(range(5)))
    store.store_blocks(hashes[5:], stack(range(5, 7)))
    assert submitted == ["_write_file", "_write_file"]          # a batch goes over in one task, as one file
    payload = sum(t.numel() * t.element_size() for t in blocks[0].values())
    assert sizes == [(5 * payload + HEADER_BYTES) // 5 + HASH_BYTES] * 5
    order = [0, 1, 2, 5, 6, 3]
    runs = store.load_blocks([hashes[i] for i in order])
    assert [next(iter(run.values())).shape[0] for run in runs] == [3, 2, 1]   # rows 0-2 | 5-6 | 3
    rows = [{name: t[i] for name, t in run.items()} for run in runs for i in range(next(iter(run.values())).shape[0])]
    assert all(torch.equal(r[k], blocks[i][k]) for r, i in zip(rows, order) for k in blocks[0])
    assert len(threads) == 2 and all(name.startswith("flashnext-disk-writer") for name in threads), threads
    assert len(readers) == 2 and all(name.startswith("flashnext-disk-reader") for name in readers), readers
    store.drop_block(hashes[5])
    store.flush()
    assert len(list((tmp_path / "batches").iterdir())) == 2              # the second batch keeps its other block
    store.drop_block(hashes[6])
    store.flush()
    assert len(list((tmp_path / "batches").iterdir())) == 1              # and goes with its last


def test_writer_gets_host_copies_of_its_own():
    """What goes to the writer thread shares no memory with host inputs: the host tier's arena hands a dropped
    entry's buffer out again while the write may still wait in the queue."""
    from flashnext.cache.cache_entry import copy_tensors

    buf = torch.arange(64, dtype=torch.float32)
    out = copy_tensors({"a": buf[:16], "b": buf[16:48].view(4, 8)}, "cpu")   # what DiskStore._write hands over
    buf.zero_()
    assert torch.equal(out["a"], torch.arange(16, dtype=torch.float32)) and out["b"].shape == (4, 8)
    assert out["b"][0, 0] == 16


def test_dropped_rows_of_a_live_batch_count_until_its_file_goes(tmp_path):
    """A batch file goes with its last block; its dropped rows stay on disk meanwhile and count against the budget
    (dead_bytes): the tier evicts to stay under it, and after a restart the file is still there for the entry that
    needs it."""
    from flashnext.cache.disk_tier import DiskTier

    store = DiskStore(tmp_path, "model-a")
    tier = DiskTier(store, 1 << 30, 16)
    a, b = bytes([1]) * 16, bytes([2]) * 16
    _entry(tier, [a, b], b"\xaa" * 16, 0)          # one batch file [a, b]
    _entry(tier, [a], b"\xbb" * 16, 10)            # needs a only (stored already)
    tier.remove(b"\xaa" * 16)                      # b dropped: its row is dead, the file stays for a
    store.flush()
    row = store.block_bytes(a)
    assert store.dead_bytes == row and len(list(store.batch_dir.iterdir())) == 1
    again = DiskTier(DiskStore(tmp_path, "model-a"), 1 << 30, 16)     # a restart: b is dead there too
    assert list(again.snaps) == [b"\xbb" * 16] and again.store.dead_bytes == again.store.block_bytes(a)
    runs, _ = again.load(b"\xbb" * 16)
    assert torch.equal(runs[0]["k.3"][0], _block(0)["k.3"])   # a as entry aa stored it
    tier.capacity = tier.bytes + store.dead_bytes - 1   # the dead row tips it over: the last entry goes, its file too
    tier.fit()
    store.flush()
    assert not tier.snaps and store.dead_bytes == 0 and not list(store.batch_dir.iterdir())


def test_a_block_in_two_batch_files_is_read_from_one_and_the_other_file_goes(tmp_path):
    """A block dropped from a batch that lives on, then stored again, is in two files: after a restart one of
    them serves it and a file left with no block of its own is deleted; a block no file holds, or a file whose
    rows disagree with its header, fails as a damaged entry (the request is computed)."""
    from flashnext.cache.tier_index import CorruptEntry

    store = DiskStore(tmp_path, "model-a")
    a, b = bytes([1]) * 16, bytes([2]) * 16
    store.store_blocks([a, b], {k: torch.stack([_block(0)[k], _block(1)[k]]) for k in _block(0)})
    store.drop_block(a)
    store_one(store, a, _block(0))
    store.flush()
    assert len(list(store.batch_dir.iterdir())) == 2
    again = DiskStore(tmp_path, "model-a")
    assert set(again.rows) == {a, b}
    again.keep_only({a})       # whichever file serves a, the other goes: b was the other's only block, or none
    again.flush()
    assert len(list(store.batch_dir.iterdir())) == 1
    assert torch.equal(load_one(again, a)["k.3"], _block(0)["k.3"])
    with pytest.raises(CorruptEntry, match="not in"):
        again.load_blocks([bytes([9]) * 16])
    again.batches[again.rows[a][0]].rows = 3       # as if the header named a block more than the file holds
    with pytest.raises(CorruptEntry, match="number of blocks"):
        again.load_blocks([a])
