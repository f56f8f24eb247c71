"""Which device snapshots the prefix cache lets go of first, and where they go: a hit moves its entry to the back of
the least-recently-used order; over the snapshot budget the snapshots taken inside a prefill that nothing resumed from
go first (oldest first), then the ends of prompts and replies; evicted, those inside a prefill are dropped — by the
budget, by KV pressure or at shutdown (PrefixCache.persist) — while ends, and a snapshot a request resumed from, go
down to the lower tier with their blocks. (Run end to end: tests/test_prefix_cache.py.) No model runs here: each
"sequence" is KV blocks and a state slot filled with a value of its own, snapshotted as the scheduler would."""
import pytest
import torch

from flashnext.cache.host_tier import HostStore
from flashnext.cache.kv_pool import KVPool
from flashnext.cache.prefix_cache import PrefixCache
from flashnext.cache.state_pool import StatePool
from flashnext.cache.tier_index import TierIndex
from flashnext.weights.config import parse_config
from flashnext.weights.presets import get_preset

CFG = parse_config(get_preset("tiny-flash-next"))
BS = KVPool.fit_block_size(CFG, 16)


def pools(num_blocks=40):
    return (KVPool(CFG, num_blocks, BS, torch.float32, torch.device("cpu")),
            StatePool(CFG, 4, torch.float32, torch.device("cpu")))


def prompt(value: int, blocks: int = 4) -> list[int]:
    return [value * 1000 + i for i in range(blocks * BS)]


def snapshots(cache, tokens, *points):
    """A sequence of `tokens` (its KV blocks and state slot filled with its prompt's number) snapshotted at each
    (num_tokens, inside_prefill) in turn, as its prefill reaches them; then it finishes (its own references go)."""
    kv, states = cache.kv, cache.states
    blocks, slot, value = kv.allocate(kv.blocks_for(len(tokens))), states.allocate(), tokens[0] // 1000
    for group in (kv.k, kv.v, kv.index_keys):
        for t in group.values():
            t[blocks] = value
    for t in states.tensors().values():
        t[slot] = value
    for n, inside in points:
        cache.insert(tokens, blocks, slot, n, inside_prefill=inside)
    kv.release(blocks)
    states.release(slot)


def held(cache) -> list[tuple[int, int]]:
    """(its prompt's first token // 1000, its tokens) of each device snapshot, least recently used first."""
    return [(node.path()[0].key[0] // 1000, node.snapshots[tail].num_tokens) for node, tail in cache.lru.values()]


def state_bytes(states) -> int:
    return sum(t[0].numel() * t.element_size() for t in states.tensors().values())


def test_a_hit_is_not_the_next_entry_evicted():
    """lookup touches the entry it returns: over the snapshot budget and under KV pressure alike, the entry last hit
    outlives one inserted after it."""
    kv, states = pools()
    cache = PrefixCache(kv, states, 2 * state_bytes(states))     # room for two block-aligned snapshots
    a, b, c = prompt(1, 2), prompt(2, 2), prompt(3, 2)
    snapshots(cache, a, (32, False))
    snapshots(cache, b, (32, False))
    assert cache.lookup(a + [7], len(a)).num_tokens == 32
    assert held(cache) == [(2, 32), (1, 32)]
    snapshots(cache, c, (32, False))                            # over the budget: b goes, not a
    assert held(cache) == [(1, 32), (3, 32)]
    assert cache.lookup(a + [7], len(a)).num_tokens == 32
    assert cache.free_blocks(kv.num_free + 1)                   # short of one block: c's two go, not a's
    assert held(cache) == [(1, 32)] and cache.lookup(c + [7], len(c)) is None


def test_over_the_budget_snapshots_inside_a_prefill_go_first():
    """The victim over the snapshot budget is the oldest snapshot inside a prefill, however old the ends are; one a
    request resumed from is an end since, and so is one taken again at an end (never the other way round); with none
    inside a prefill left, the least recently used end goes."""
    kv, states = pools()
    cache = PrefixCache(kv, states, 4 * state_bytes(states))
    p = {i: prompt(i, 2) for i in range(1, 7)}
    snapshots(cache, p[1], (16, True))                          # inside 1's prefill ...
    snapshots(cache, p[2], (32, False))                         # an end
    assert cache.lookup(p[1] + [7], 17).num_tokens == 16        # ... resumed from: an end now
    snapshots(cache, p[3], (16, True), (32, True), (32, False), (32, True))   # 32: taken again at an end, then inside
    assert held(cache) == [(2, 32), (1, 16), (3, 16), (3, 32)] and len(cache.inside_prefill) == 1
    snapshots(cache, p[4], (32, False))                         # over: the one inside 3's prefill, not the older ends
    assert held(cache) == [(2, 32), (1, 16), (3, 32), (4, 32)] and not cache.inside_prefill
    snapshots(cache, p[5], (32, False))                         # none inside a prefill: the least recently used end
    assert held(cache) == [(1, 16), (3, 32), (4, 32), (5, 32)]
    snapshots(cache, p[6], (16, True))                          # the newest, but taken inside a prefill: it goes
    assert held(cache) == [(1, 16), (3, 32), (4, 32), (5, 32)] and not cache.inside_prefill


def test_evicted_snapshots_inside_a_prefill_are_dropped_and_the_rest_go_down():
    """Evicted over the snapshot budget or for KV blocks, a snapshot taken inside a prefill that nothing resumed from is
    dropped, not written down to the host tier: its blocks go down with its prompt's end, which comes back with that
    sequence's state and blocks; a prompt sharing only the start finds nothing below (the price the docs name). One a
    request resumed from goes down like an end."""
    kv, states = pools()
    host = TierIndex(HostStore(1 << 26), 1 << 26, BS)
    cache = PrefixCache(kv, states, state_bytes(states), host)   # room for one block-aligned snapshot
    a, b = prompt(1), prompt(2)
    snapshots(cache, a, (32, True), (64, False))        # over the budget: the one inside a's prefill goes ...
    assert held(cache) == [(1, 64)] and not host.snaps  # ... dropped
    cache.snapshot_budget = 1 << 40
    snapshots(cache, b, (32, True), (48, True), (64, False))
    assert cache.lookup(b[:40] + [7], 40).num_tokens == 32       # resumed from: an end now; 48 never was
    assert cache.free_blocks(kv.num_blocks) and not cache.lru    # KV pressure: every entry goes
    assert sorted(meta.num_tokens for meta in host.snaps.values()) == [32, 64, 64] and len(host.block_refs) == 8
    hit = cache.lookup(a + [7], len(a))                            # a's end back from the host tier
    assert hit.num_tokens == 64 and len(hit.blocks) == 4
    assert all(bool((t == 1).all()) for t in hit.snapshot.state.values())
    assert all(bool((t[hit.blocks] == 1).all()) for group in (kv.k, kv.v, kv.index_keys) for t in group.values())
    assert cache.lookup(a[:40] + [7], 40) is None                 # a's 32 was not kept anywhere
    assert cache.lookup(b[:56] + [7], 56).num_tokens == 32        # b's 48 neither


def test_shutdown_persists_the_ends_not_the_snapshots_inside_a_prefill(tmp_path):
    """PrefixCache.persist (a clean shutdown without write-through) writes the device's ends of prompts and replies to
    the disk tier, and a snapshot inside a prefill once a request resumed from it, but not those nothing resumed from,
    which an eviction would have dropped too."""
    from test_prefix_cache import make, run, tokens

    engine = make(kv_disk_dir=str(tmp_path))
    cache = engine.prefix_cache
    a = tokens(20, 150)
    reply, _ = run(engine, a, rid="a")               # chunks of 64, interval 32: inside at 64 and 128
    depth = lambda key: cache.lru[key][0].snapshots[cache.lru[key][1]].num_tokens  # noqa: E731
    assert sorted(map(depth, cache.inside_prefill)) == [64, 128]
    assert sorted(map(depth, cache.lru)) == [64, 128, 150, 150 + len(reply) - 1]
    b = a[:130] + tokens(21, 20)
    assert run(engine, b, rid="b")[1] == 128        # resumed from 128: an end now
    assert sorted(map(depth, cache.inside_prefill)) == [64]
    assert cache.persist() == 5
    assert sorted(meta.num_tokens for meta in cache.lower.snaps.values()) == [128, 150, 150, 155, 155]
