"""Admitting a waiting request onto a prefix hit (Scheduler.schedule): the hit's KV blocks are shared before the
cache is asked for room, so its eviction cannot free them under the request; an admission that still finds no room
gives that share back (KVPool.unshare) and the request waits — holding no block, no slot — to be admitted later,
exactly."""
from collections import Counter

import torch

from flashnext.cache.kv_pool import KVPool
from flashnext.engine.request import Status
from flashnext.engine.sampling_params import SamplingParams
from flashnext.weights.config import parse_config
from flashnext.weights.presets import get_preset
from test_prefix_cache import BS, cold, make, pools_idle, tokens


def holders(engine) -> Counter:
    """References every KV block should have: one per running request that lists it, one per cache node."""
    refs = Counter(b for r in engine.scheduler.running for b in r.blocks)
    stack = list(engine.prefix_cache.root.children.values())
    while stack:
        node = stack.pop()
        refs[node.block] += 1
        stack.extend(node.children.values())
    return refs


def test_an_admission_without_room_gives_its_prefix_hit_back():
    per_block = KVPool.bytes_per_block(parse_config(get_preset("tiny-flash-next")), BS, torch.float32)
    engine = make(kv_cache_gb=20 * per_block / 2**30, prefix_snapshot_interval=0, max_model_len=256)
    kv, cache = engine.kv, engine.prefix_cache
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    a = tokens(60, 70)
    engine.add_request("a", a, greedy(1))
    while engine.has_work():
        engine.step()
    (node, tail), = cache.lru.values()                     # a's end: 4 full blocks (64) and 6 tail tokens
    hit_blocks = [n.block for n in node.path()]
    assert len(hit_blocks) == 4 and len(tail) == 6
    engine.add_request("c", tokens(61, 200), greedy(12))
    while not engine.requests["c"].output_ids:             # c holds 13 blocks and decodes; 3 are free
        engine.step()
    assert kv.num_free == 3
    d = a + tokens(62, 60)                                  # a's end hits: 4 shared blocks, 5 more needed for 130
    engine.add_request("d", d, greedy(4))
    engine.step()
    request = engine.requests["d"]
    # no room even after evicting a's entry (its blocks were held by d's share meanwhile): d waits, holding nothing,
    # and a's blocks are free again — d's share given back, not leaked
    assert request.status is Status.WAITING and request.blocks == [] and request.slot is None
    assert cache.num_snapshots == 0
    assert all(kv.refcount[b] == 0 for b in hit_blocks) and kv.num_free == 3 + len(hit_blocks)
    assert Counter({b: n for b, n in enumerate(kv.refcount) if n}) == holders(engine)
    out = []
    while engine.has_work():
        out += [t for o in engine.step() if o.request_id == "d" for t in o.token_ids]
    assert out == cold(engine, d, 4)
    pools_idle(engine)
