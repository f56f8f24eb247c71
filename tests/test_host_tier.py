"""Blocks move between the device pool and the host tier in batches: a conversation's blocks stored together
come back as one run of views (one copy per pool tensor, not per block), batch_rows and write_blocks put the
same bytes where per-block copies would, and a batch's memory goes with its last block."""
import pytest
import torch

from flashnext.cache import cache_entry
from flashnext.cache.cache_entry import batch_rows, read_block, read_blocks, run_rows, write_blocks
from flashnext.cache.host_tier import HostStore
from flashnext.cache.kv_pool import KVPool
from flashnext.weights.config import parse_config
from flashnext.weights.presets import get_preset


def pool(seed=None, blocks=12):
    cfg = parse_config(get_preset("tiny-flash-next"))
    kv = KVPool(cfg, blocks, KVPool.fit_block_size(cfg, 16), torch.float32, torch.device("cpu"))
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for group in ("k", "v", "index_keys"):
            for t in getattr(kv, group).values():
                t.copy_(torch.randn(t.shape, generator=gen))
    return kv


def hashes(n, salt=0):
    return [bytes([salt, i]) * 8 for i in range(n)]


def test_blocks_stored_together_load_as_one_run_of_views():
    kv, store = pool(seed=1), HostStore()
    hs = hashes(5)
    sizes = store.store_blocks(hs, read_blocks(kv, [7, 2, 9, 0, 4]))
    assert sizes == [sum(t.nbytes for t in read_block(kv, 0).values())] * 5
    runs = store.load_blocks(hs)       # 5 blocks = pieces of 4 + 1 (power-of-two pinned allocations)
    assert [run_rows(run) for run in runs] == [4, 1]
    for run in runs:
        batch = store.batches[store.rows[hs[0 if run is runs[0] else 4]][0]]
        assert all(t.data_ptr() == batch[name].data_ptr() for name, t in run.items())   # views of the store
    for row, block in enumerate([7, 2, 9, 0, 4]):
        for name, t in read_block(kv, block).items():
            assert torch.equal(batch_rows(runs, [row])[name][0], t) and torch.equal(store.load_blocks([hs[row]])[0][name][0], t)
    assert len(store.load_blocks([hs[0], hs[1], hs[3]])) == 2


def test_a_batch_is_freed_with_its_last_block():
    kv, store = pool(seed=2), HostStore()
    hs = hashes(4)     # one power-of-two piece: one batch
    store.store_blocks(hs, read_blocks(kv, [0, 1, 2, 3]))
    store.store_blocks([b"single" * 3], read_blocks(kv, [5]))
    for h in hs[:3]:
        store.drop_block(h)
    assert len(store.batches) == 2
    store.drop_block(hs[3])
    assert len(store.batches) == 1 and len(store.load_blocks([b"single" * 3])) == 1


def test_batch_rows_is_a_view_inside_one_run_and_a_copy_across_runs():
    kv = pool(seed=3)
    runs = [read_blocks(kv, [0, 1]), read_blocks(kv, [2, 3, 4])]
    inside = batch_rows(runs, [2, 3, 4])
    across = batch_rows(runs, [1, 2, 4])
    every = batch_rows(runs, [0, 1, 2, 3, 4])   # one range across both runs: a slice of each
    for name in runs[0]:
        assert inside[name].data_ptr() == runs[1][name].data_ptr()
        want = torch.stack([read_block(kv, b)[name] for b in (1, 2, 4)])
        assert torch.equal(across[name], want)
        assert torch.equal(every[name], torch.stack([read_block(kv, b)[name] for b in range(5)]))


@pytest.mark.parametrize("piece", [2, 256])
def test_write_blocks_equals_per_block_copies(monkeypatch, piece):
    monkeypatch.setattr(cache_entry, "WRITE_PIECE", piece)
    source, target = pool(seed=4), pool()
    runs = [read_blocks(source, [3, 1]), read_blocks(source, [4, 1, 5])]
    with monkeypatch.context() as patch:   # rows across runs are copied from each run, not joined on the host
        for join in ("cat", "stack"):
            patch.setattr(torch, join, lambda *a, **k: pytest.fail("joined on the host"))
        write_blocks(target, [0, 6, 2, 8], runs, [0, 1, 2, 4])
    for src, dst in zip([3, 1, 4, 5], [0, 6, 2, 8]):
        for name, t in read_block(target, dst).items():
            assert torch.equal(t, read_block(source, src)[name])
    untouched = read_block(target, 7)
    assert all(not t.any() for t in untouched.values())


def test_write_blocks_copies_runs_of_consecutive_blocks_straight_in(monkeypatch):
    """Stretches of DIRECT_MIN_BLOCKS rows of one run bound for consecutive blocks are one copy a tensor into the
    blocks (no scatter); the other rows are scattered; every block ends up with its row's bytes."""
    monkeypatch.setattr(cache_entry, "DIRECT_MIN_BLOCKS", 3)
    source, target = pool(seed=5, blocks=16), pool(blocks=16)
    runs = [read_blocks(source, [0, 1, 2, 3, 4]), read_blocks(source, [5, 6, 7, 8, 9, 10])]
    rows = list(range(11))
    blocks = [2, 3, 4, 5, 9, 13, 14, 15, 0, 1, 11]   # 2–5 (the first run's rows 0–3) and 13–15 (the second's 0–2)
    direct, rest = cache_entry._direct_stretches(runs, blocks, rows)
    assert direct == [(0, 0, 2, 4), (1, 0, 13, 3)]
    assert rest == [(9, 4), (0, 8), (1, 9), (11, 10)]
    scattered = []
    real = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda t, d, i, src: scattered.append(len(i)) or real(t, d, i, src))
    write_blocks(target, blocks, runs, rows)
    assert sum(scattered) == 4 * len(list(cache_entry._pool_tensors(target)))
    for src, dst in zip(range(11), blocks):
        for name, t in read_block(target, dst).items():
            assert torch.equal(t, read_block(source, src)[name])


def test_blocks_freed_together_are_allocated_again_in_ascending_order():
    kv = pool(blocks=12)
    first = kv.allocate(6)
    kv.release(first)
    again = kv.allocate(4)   # the last four freed, which the free list hands out last first
    assert again == [2, 3, 4, 5]


def test_put_reads_a_long_conversation_in_pieces(monkeypatch):
    """TierIndex.put gathers at most WRITE_PIECE blocks at a time (a whole 58K-token conversation at once was a
    1.5 GB device allocation while the pool is short); the entry comes back whole and in order."""
    from flashnext.cache.cache_entry import WRITE_PIECE, Snapshot
    from flashnext.cache.tier_index import TierIndex

    n = 2 * WRITE_PIECE + 37
    blocks = {"k.3": torch.randn(n, 16, 2, 8), "v.3": torch.randn(n, 16, 2, 8)}
    asked = []

    def get_blocks(rows):
        asked.append(len(rows))
        return {name: t[rows] for name, t in blocks.items()}

    tier = TierIndex(HostStore(), 1 << 30, 16)
    hashes = [i.to_bytes(16, "little") for i in range(n)]
    tier.put(hashes, get_blocks, b"k" * 16, Snapshot(16 * n, (), {"ssm.0": torch.randn(2, 4)}, None))
    assert asked == [WRITE_PIECE, WRITE_PIECE, 37]
    runs, _ = tier.load(b"k" * 16)
    assert all(torch.equal(torch.cat([run[name] for run in runs]), t) for name, t in blocks.items())


def test_host_copies_share_one_buffer():
    """copy_tensors to the host: views of one allocation at aligned offsets, equal to the sources, any dtype and
    shape (empty ones too), independent of them afterwards."""
    from flashnext.cache.cache_entry import PIN_ALIGN, copy_tensors

    src = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int16), "c": torch.zeros(0, 4),
           "d": torch.rand(2, 3) > 0.5, "e": torch.randn(4, 2, dtype=torch.float64).t()}
    out = copy_tensors(src, "cpu")
    base = out["a"].untyped_storage().data_ptr()
    for name, t in src.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape and torch.equal(out[name], t), name
        assert out[name].untyped_storage().data_ptr() == base and out[name].data_ptr() % PIN_ALIGN == base % PIN_ALIGN
    src["a"].add_(1)
    assert not torch.equal(out["a"], src["a"])


def test_arena_recycles_buffers_by_size():
    """PinnedArena: buffers of whole pages carved from slabs, handed out again after give_back to a request of
    the same size (not another), None beyond its capacity; the host store gives an entry's buffers back when it
    drops the entry, and what it loads back equals what went down."""
    from flashnext.cache import pinned_arena
    from flashnext.cache.pinned_arena import PAGE, PinnedArena, size_class

    assert size_class(1) == PAGE and size_class(PAGE + 1) == 2 * PAGE and size_class(3 * PAGE) == 3 * PAGE
    arena = PinnedArena(2 * pinned_arena.SLAB_BYTES, pin=False)
    a = arena.take(100_000)
    b = arena.take(100_000)
    assert a.numel() == 100_000 and b.data_ptr() - a.data_ptr() == size_class(100_000)
    arena.give_back(a)
    assert arena.take(70_000).data_ptr() not in (a.data_ptr(), b.data_ptr())   # another size: a new buffer
    assert arena.take(99_000).data_ptr() == a.data_ptr()          # the same pages: recycled
    assert arena.take(3 * pinned_arena.SLAB_BYTES) is None and arena.misses == 1
    assert arena.take(pinned_arena.SLAB_BYTES) is not None        # a second slab, the last the capacity allows
    assert arena.take(pinned_arena.SLAB_BYTES) is None and arena.reserved == 2 * pinned_arena.SLAB_BYTES

    store = HostStore(pinned_arena.SLAB_BYTES)
    state = {"s": torch.randn(40, 33), "c": torch.arange(12, dtype=torch.int32)}
    store.store_snapshot(b"k", (state, None), None)
    loaded, _ = store.load_snapshot(b"k")
    assert all(torch.equal(loaded[n], state[n]) for n in state)
    held = store.buffers[b"k"][0].data_ptr()
    store.drop_snapshot(b"k")
    assert b"k" not in store.buffers
    store.store_snapshot(b"j", ({"s": torch.randn(40, 33), "c": torch.ones(12, dtype=torch.int32)}, None), None)
    assert store.buffers[b"j"][0].data_ptr() == held                 # the dropped snapshot's buffer, reused
    small = PinnedArena(3 * PAGE + 5, pin=False)                     # a tier under a slab: one slab of its size
    assert small.slab_bytes == 3 * PAGE and small.take(100) is not None
    ahead = PinnedArena(2 * pinned_arena.SLAB_BYTES + PAGE, pin=False)
    ahead.reserve()                                                  # every slab the capacity allows, at once
    slabs = [s.data_ptr() for s in ahead.slabs]
    assert len(slabs) == 2 and ahead.take(100).data_ptr() == slabs[0]
    assert ahead.take(pinned_arena.SLAB_BYTES).data_ptr() == slabs[1]   # the first is used: the reserved second
    assert ahead.take(PAGE) is None and [s.data_ptr() for s in ahead.slabs] == slabs


def test_entry_evicted_from_the_host_while_it_is_installed(monkeypatch):
    """Installing a host entry may evict device entries down to the host, which can push that very entry out of
    the host tier: it is kept there until the install ends (TierIndex.installing), or its buffers would be
    handed out again to the entries coming down — B's way down pushed A out, C's snapshot and 2-block piece
    reused A's buffers, and the resumed conversation read C's state and blocks (the regression)."""
    from flashnext.cache import pinned_arena
    from flashnext.cache.cache_entry import read_block
    from flashnext.cache.prefix_cache import PrefixCache
    from flashnext.cache.state_pool import StatePool
    from flashnext.cache.tier_index import TierIndex

    monkeypatch.setattr(pinned_arena, "SLAB_BYTES", 1 << 22)
    cfg = parse_config(get_preset("tiny-flash-next"))
    bs = KVPool.fit_block_size(cfg, 16)
    kv = KVPool(cfg, 6, bs, torch.float32, torch.device("cpu"))
    states = StatePool(cfg, 4, torch.float32, torch.device("cpu"))

    def conversation(seed, value, n):
        tokens, blocks, slot = [seed * 100 + i for i in range(n * bs)], kv.allocate(n), states.allocate()
        for group in (kv.k, kv.v, kv.index_keys):
            for t in group.values():
                t[blocks] = value
        for t in states.tensors().values():
            t[slot] = value
        return tokens, blocks, slot

    snap_bytes = sum(t[0].numel() * t.element_size() for t in states.tensors().values())
    block_bytes = sum(t[0].numel() * t.element_size() for g in (kv.k, kv.v, kv.index_keys) for t in g.values())
    host = TierIndex(HostStore(pinned_arena.SLAB_BYTES), int(2 * snap_bytes + 2.5 * block_bytes), bs)
    cache = PrefixCache(kv, states, 10 ** 9, host)
    ta, ba, sa = conversation(1, 1.0, 2)          # A goes down to the host
    cache.insert(ta, ba, sa, 2 * bs)
    kv.release(ba)
    states.release(sa)
    cache.evict_all()
    for seed, value, n in ((2, 2.0, 1), (3, 3.0, 2)):   # B and C on the device; C's blocks as many as A's
        tokens, blocks, slot = conversation(seed, value, n)
        cache.insert(tokens, blocks, slot, n * bs)
        kv.release(blocks)
        states.release(slot)
    kv.allocate(kv.num_free)                       # every other block in use: installing A evicts B, then C
    hit = cache.lookup(ta + [0], 2 * bs)
    assert hit is not None and hit.num_tokens == 2 * bs
    assert {float(read_block(kv, b)[f"k.{next(iter(kv.k))}"].flatten()[0]) for b in hit.blocks} == {1.0}
    assert all(float(t.flatten()[0]) == 1.0 for t in hit.snapshot.state.values())


def test_fit_lets_go_of_entries_held_above_first():
    """Entries the tier above still holds (copied down ahead of their eviction) are the first a full tier drops, and
    they are dropped, not moved down: an older entry held only here stays."""
    from flashnext.cache.cache_entry import Snapshot
    from flashnext.cache.tier_index import TierIndex

    lower = TierIndex(HostStore(), 1 << 30, 16)
    tier = TierIndex(HostStore(), 1 << 30, 16, lower)

    def put(name: bytes):
        blocks = {"k.3": torch.randn(2, 16, 2, 8)}
        tier.put([name + bytes([i]) * 15 for i in range(2)], lambda rows: {k: t[rows] for k, t in blocks.items()},
                 name * 16, Snapshot(32, (), {"ssm.0": torch.randn(2, 4)}, None))

    put(b"a")                      # held only here, the least recently used
    put(b"b")
    tier.held_above.add(b"b" * 16)
    put(b"c")
    tier.capacity = tier.used_bytes - 1
    tier.fit()
    assert list(tier.snaps) == [b"a" * 16, b"c" * 16] and not lower.snaps and not tier.held_above
    tier.fit()                     # fits now: nothing more goes
    assert list(tier.snaps) == [b"a" * 16, b"c" * 16]
    tier.capacity = tier.used_bytes - 1
    tier.fit()                     # nothing held above: the least recently used moves down, as before
    assert list(tier.snaps) == [b"c" * 16] and list(lower.snaps) == [b"a" * 16]


def test_host_tier_larger_than_free_memory_is_refused_before_pinning(monkeypatch):
    """On a GPU the host tier is page-locked at startup (PinnedArena.reserve): a budget over the host's available
    memory is a clear error then, not a failed or starving page-lock."""
    from flashnext.cache import host_tier

    monkeypatch.setattr(host_tier.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_tier, "meminfo_bytes", lambda field: 3 << 30 if field == "MemAvailable" else None)
    reserved = []
    monkeypatch.setattr(host_tier.PinnedArena, "reserve", lambda self: reserved.append(self))
    with pytest.raises(ValueError, match="more than the 3.0 GiB of host memory available"):
        host_tier.HostStore(40 << 30)
    assert not reserved
    host_tier.HostStore(2 << 30)
    assert len(reserved) == 1


def test_row_runs_and_segments_merge_consecutive_rows():
    """row_runs / row_segments against a row-at-a-time reference: runs break where the batch changes or a row skips,
    and at a run's end even when the next run's first row follows in the numbering."""
    import random

    from flashnext.cache.cache_entry import row_segments
    from flashnext.cache.tier_index import row_runs

    def merged(places):
        out = []
        for key, row in places:
            if out and out[-1][0] == key and out[-1][1] + out[-1][2] == row:
                out[-1] = (key, out[-1][1], out[-1][2] + 1)
            else:
                out.append((key, row, 1))
        return out

    rng = random.Random(3)
    for _ in range(200):
        places = [(rng.randrange(3), rng.randrange(6)) for _ in range(rng.randrange(0, 12))]
        assert row_runs(places) == merged(places)
        sizes = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 5))]
        runs = [{"k": torch.zeros(n, 1)} for n in sizes]
        rows = sorted(rng.sample(range(sum(sizes)), rng.randrange(0, sum(sizes) + 1)))
        if rng.random() < 0.3:
            rows = rows[::-1]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        where = [(max(i for i, s in enumerate(starts) if s <= r), r - max(s for s in starts if s <= r)) for r in rows]
        assert row_segments(runs, rows) == merged(where)


def test_releases_count_blocks_given_up_not_admissions_undone():
    """KVPool.releases (what a disk read waiting for room watches, PrefixCache.waiting_for_read) moves when a request
    gives blocks up, not when an admission that did not happen undoes its share, nor for nothing."""
    kv = pool(blocks=4)
    blocks = kv.allocate(2)
    kv.share(blocks)
    kv.unshare(blocks)
    kv.release([])
    assert kv.releases == 0 and kv.num_free == 2
    kv.release(blocks)
    assert kv.releases == 1 and kv.num_free == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: copies down are asynchronous only there")
def test_copies_down_wait_for_the_device_hold_their_source_and_are_waited_for():
    """On a GPU the host tier's copies down run on a stream of their own (cache/host_copies.py), not waited for. What
    they copy is what the device's stream queued before them (here behind ~0.5 s of sleep); the device memory they
    read is not handed out again before they have read it (a tensor allocated over the freed source and filled at
    once must not leak into the copy); a load of blocks or of a snapshot waits for them."""
    store = HostStore(64 << 20)
    rows, width = 4, 1 << 20                            # 16 MB of blocks
    names = hashes(rows, salt=9)
    # the page-locked buffers exist before the timed part (their allocation took longer than a short sleep, H200)
    store.store_blocks(hashes(rows, salt=10), {"k": torch.zeros(rows, width, device="cuda")})
    store.flush()
    source = torch.zeros(rows, width, device="cuda")
    torch.cuda._sleep(1_000_000_000)                    # ~0.5 s of the device's stream: far past the host's calls
    source.fill_(7.0)
    store.store_blocks(names, {"k": source})
    del source
    over = torch.full((rows, width), 3.0, device="cuda")
    assert store.copying()                              # still behind the sleep: nothing waited for it
    runs = store.load_blocks(names)
    assert sum(run_rows(r) for r in runs) == rows and all(bool((r["k"] == 7.0).all()) for r in runs)
    state = {"s": torch.zeros(width, device="cuda")}
    torch.cuda._sleep(50_000_000)
    state["s"].fill_(5.0)
    store.store_snapshot(b"snap", (state, None), None)
    loaded, _ = store.load_snapshot(b"snap")
    assert bool((loaded["s"] == 5.0).all())
    del over   # kept until here: what would have taken the source's memory
    store.flush()
    assert not store.copying()
