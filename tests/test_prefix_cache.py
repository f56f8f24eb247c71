"""Prefix cache for hybrid models: a hit (at a snapshot boundary, at the end of a prompt, at the end of a
previous reply, after a trip through host RAM or disk) gives exactly the cold output; cached_tokens says
what was reused; damaged or foreign disk files are ignored; tiny budgets stay exact and leak nothing."""
import logging
import random
from collections import Counter

import pytest

from flashnext.engine.args import EngineArgs
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.sampling_params import SamplingParams
from flashnext.models.session import Session

BS = 16   # the tiny presets' KV block size


def make(model="tiny-flash-next", loaded=None, **kw):
    args = dict(model=model, device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                max_model_len=512, prefix_snapshot_interval=32)
    return LLMEngine(EngineArgs(**{**args, **kw}), loaded=loaded)


@pytest.fixture(scope="module", params=["tiny-flash-next", "tiny-qwen3-next"])
def engine(request):
    return make(request.param)


@pytest.fixture(scope="module")
def flash():
    return make()


def cold(engine, prompt, n):
    return Session(engine.loaded.model, 512).greedy(prompt, n)


def run(engine, prompt, n=6, rid="r", history_len=None):
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), history_len)
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished
    return [t for o in outs for t in o.token_ids], outs[-1].cached_tokens


def tokens(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 480) for _ in range(n)]


def disk_tier(engine):
    tier = engine.prefix_cache.lower
    while tier.lower is not None:
        tier = tier.lower
    assert tier.name == "disk"
    return tier


def restart_point(engine):
    """What ending the process does for a restarted engine: the disk writer's files are all written."""
    disk_tier(engine).store.flush()


def turn_two_on_disk(flash, directory, seed):
    """A conversation's first turn written through to a disk tier under `directory` by an engine that then
    stops: → (its second turn's prompt, the cold output of that prompt)."""
    first = make(loaded=flash.loaded, kv_disk_dir=str(directory), kv_host_gb=0.05, kv_host_write_through=True)
    prompt = tokens(seed, 70)
    reply, _ = run(first, prompt)
    turn2 = prompt + reply + tokens(seed + 1, 4)
    expected = cold(first, turn2, 6)
    restart_point(first)
    pools_idle(first)
    return turn2, expected


def pools_idle(engine):
    engine.prefix_cache.clear()
    assert engine.kv.num_free == engine.kv.num_blocks and all(c == 0 for c in engine.kv.refcount)
    assert engine.states.num_free == engine.states.num_slots


def test_hits_equal_cold_run(engine):
    engine.prefix_cache.clear()
    before = engine.stats()
    prompt = tokens(1, 100)
    reply, cached = run(engine, prompt)
    assert cached == 0 and reply == cold(engine, prompt, 6)
    # The same prompt again: the deepest snapshot at most len-1 deep is the end of the first 64-token chunk
    # (which crossed the 32 and 64 marks; chunks are never cut for snapshots).
    assert run(engine, prompt) == (reply, 64)
    # A shared prefix that diverges at 70: the snapshot at 64.
    other = prompt[:70] + tokens(2, 9)
    assert run(engine, other) == (cold(engine, other, 6), 64)
    # Multi-turn: turn 2 = turn 1 prompt + reply + new text; all but the last reply token are cached.
    turn2 = prompt + reply + tokens(3, 7)
    out2, cached = run(engine, turn2)
    assert cached == len(prompt) + len(reply) - 1 and out2 == cold(engine, turn2, 6)
    # An edited reply: the end-of-prompt snapshot (100 = 6 blocks + 4, a partial block copied on resume).
    edited = prompt + tokens(4, 5)
    assert run(engine, edited) == (cold(engine, edited, 6), 100)
    stats = engine.stats()
    assert stats.prefix_queries - before.prefix_queries == 100 + 100 + 79 + len(turn2) + 105
    assert stats.prefix_hits - before.prefix_hits == 64 + 64 + len(turn2) - 8 + 100
    pools_idle(engine)


def test_next_turn_resumes_where_the_history_ended(engine):
    # A chat prompt is the history plus the template's generation prompt; the next turn shares the history and
    # diverges right after it, so a chunk ends there and its snapshot serves the next turn (interval marks
    # alone would give 32 of the 50 tokens here: the interval is 32 and the chunk budget 64).
    engine.prefix_cache.clear()
    history, generation_prompt = tokens(7, 50), tokens(8, 5)
    run(engine, history + generation_prompt, history_len=len(history))
    next_turn = history + tokens(9, 20)
    out, cached = run(engine, next_turn)
    assert cached == len(history)
    assert out == cold(engine, next_turn, 6)
    pools_idle(engine)


def snapshot_depths(engine):
    return sorted(node.snapshots[tail].num_tokens for node, tail in engine.prefix_cache.lru.values())


def test_snapshots_at_chunk_ends_past_each_interval_mark(flash):
    """Chunks stay full (64 tokens here); a snapshot follows the first chunk end at or past each multiple of the
    interval, and one the end of the prompt."""
    flash.prefix_cache.clear()
    run(flash, tokens(5, 100), n=1)                 # interval 32: the 64-token chunk passes 32 and 64
    assert snapshot_depths(flash) == [64, 100]
    pools_idle(flash)
    engine = make(loaded=flash.loaded, prefix_snapshot_interval=96)
    run(engine, tokens(5, 200), n=1)                # chunk ends 64, 128 (past 96), 192 (past 192), 200
    assert snapshot_depths(engine) == [128, 192, 200]
    pools_idle(engine)


def test_host_tier_restore(flash):
    engine = make(loaded=flash.loaded, kv_host_gb=0.05)
    prompt = tokens(6, 90)
    reply, _ = run(engine, prompt)
    engine.prefix_cache.evict_all()                        # everything moves to host RAM
    assert engine.prefix_cache.num_snapshots == 0 and engine.kv.num_free == engine.kv.num_blocks
    turn2 = prompt + reply + tokens(7, 4)
    assert run(engine, turn2) == (cold(engine, turn2, 6), 95)
    pools_idle(engine)
    assert not engine.prefix_cache.lower.snaps
    # /metrics: the hit came from the host tier; every tier's bytes, budget and entries are reported
    from types import SimpleNamespace

    from flashnext.server.metrics import _EngineCollector

    assert engine.prefix_cache.restored_tokens == {"host": 95} and engine.prefix_cache.restore_seconds["host"] > 0
    families = {f.name: f for f in _EngineCollector(SimpleNamespace(served_model_name="m"), lambda: engine).collect()}
    restored = {s.labels["tier"]: s.value for s in families["flashnext_prefix_cache_restored_tokens"].samples
                if s.name.endswith("_total")}
    assert restored == {"host": 95}
    held = {s.labels["tier"]: s.value for s in families["flashnext_prefix_cache_bytes"].samples}
    budget = {s.labels["tier"]: s.value for s in families["flashnext_prefix_cache_capacity_bytes"].samples}
    assert held.keys() == budget.keys() == {"device", "host"} and held["device"] == engine.prefix_cache.snapshot_bytes
    assert budget["host"] == engine.prefix_cache.lower.capacity


def test_an_idle_engine_copies_entries_down_ahead_of_their_eviction(flash):
    """--kv-host-idle-copy (on by default): while no request runs, idle_work copies the device entries to the host
    tier a piece a call (here an entry is one piece), keeping them on the device in their order: the ends of prompts
    and replies first, then the snapshots inside a prefill, least recently used first; their eviction later copies
    nothing; a resume from the host tier stays exact. An entry that would not fit the host tier without evicting is
    left alone."""
    engine = make(loaded=flash.loaded, kv_host_gb=0.05, kv_host_write_behind=False)     # the idle copy: on by default
    first = tokens(8, 70)
    reply, _ = run(engine, first, rid="a")
    run(engine, tokens(9, 50), rid="b")
    cache, host = engine.prefix_cache, engine.prefix_cache.lower
    device = list(cache.lru)
    order = [k for k in device if k not in cache.inside_prefill] + [k for k in device if k in cache.inside_prefill]
    assert len(order) - len(cache.inside_prefill) >= 2 and cache.inside_prefill and not host.snaps
    copied = []
    while engine.idle_work():
        copied.append(next(reversed(host.snaps)))
    assert copied == order and list(cache.lru) == device and host.held_above == set(device)
    held = host.bytes
    cache.evict_all()
    assert host.bytes == held and cache.num_snapshots == 0 and not host.held_above   # now the only copies
    turn2 = first + reply + tokens(10, 4)
    assert run(engine, turn2) == (cold(engine, turn2, 6), 75)    # the reply's last token is not computed yet
    small = make(loaded=flash.loaded, kv_host_gb=1e-6, kv_host_write_behind=False)     # ~1 KB: no entry fits
    run(small, first)
    assert not small.idle_work() and not small.prefix_cache.lower.snaps
    off = make(loaded=flash.loaded, kv_host_gb=0.05, kv_host_idle_copy=False, kv_host_write_behind=False)
    run(off, first)
    assert not off.idle_work() and not off.prefix_cache.lower.snaps


def test_running_requests_write_the_cache_behind_between_steps(flash, monkeypatch):
    """--kv-host-write-behind (on by default): while requests run, a step the host has time beside (a decode step
    queued ahead — GPU only —, or a prefill step of WRITE_BEHIND_MIN_TOKENS) copies a piece of a device entry down to
    the host tier (copy_down_one, ends first, least recently used first) — no idle time needed: the entries of an
    earlier conversation reach the host tier during the next one's steps, stay on the device too, and their eviction
    then copies nothing; a resume from the host tier stays exact. Beside short prompt steps (a resumed turn's),
    nothing moves; off, nothing moves before an eviction."""
    from flashnext.engine import llm_engine

    first, second = tokens(13, 70), tokens(14, 150)     # the second prefills in three steps of at most 64 tokens
    short = make(loaded=flash.loaded, kv_host_gb=0.05, kv_host_idle_copy=False)
    run(short, first, rid="a")
    run(short, second, rid="b")
    assert not short.prefix_cache.lower.snaps                # below WRITE_BEHIND_MIN_TOKENS a step
    monkeypatch.setattr(llm_engine, "WRITE_BEHIND_MIN_TOKENS", 1)
    engine = make(loaded=flash.loaded, kv_host_gb=0.05, kv_host_idle_copy=False)
    reply, _ = run(engine, first, rid="a")
    cache, host = engine.prefix_cache, engine.prefix_cache.lower
    ends_of_a = [k for k in cache.lru if k not in cache.inside_prefill]
    run(engine, second, rid="b")
    assert ends_of_a and all(k in host.snaps and k in host.held_above and k in cache.lru for k in ends_of_a)
    held = host.bytes
    for key in ends_of_a:
        cache._evict(key)
    assert host.bytes == held                                     # written already: nothing copied at eviction
    turn2 = first + reply + tokens(15, 4)
    assert run(engine, turn2, rid="a2") == (cold(engine, turn2, 6), len(first) + len(reply) - 1)
    off = make(loaded=flash.loaded, kv_host_gb=0.05, kv_host_idle_copy=False, kv_host_write_behind=False)
    run(off, first, rid="a")
    run(off, second, rid="b")
    assert not off.prefix_cache.lower.snaps


def test_copy_down_walks_nothing_again_while_nothing_fits(flash, monkeypatch):
    """The write-behind asks copy_down_one at every decode step: with a host tier too full for any entry, each entry
    is walked at most once (kept while it waits for room) and, the state unchanged, not even that; an entry whose
    snapshot alone does not fit is never walked. Once room comes back, the entries go down."""
    from flashnext.cache import prefix_cache

    engine = make(loaded=flash.loaded, kv_host_gb=0.05, kv_host_idle_copy=False, kv_host_write_behind=False)
    run(engine, tokens(16, 70), rid="a")
    cache, host = engine.prefix_cache, engine.prefix_cache.lower
    walks = []
    real = prefix_cache._path_lists
    monkeypatch.setattr(prefix_cache, "_path_lists", lambda node: walks.append(node) or real(node))
    smallest = min(node.snapshots[tail].nbytes for node, tail in cache.lru.values())
    host.capacity = host.used_bytes + smallest          # room for a snapshot, not for its blocks
    assert not cache.copy_down_one() and 0 < len(walks) <= len(cache.lru)
    walked = len(walks)
    assert not cache.copy_down_one() and len(walks) == walked      # unchanged: nothing looked at
    cache._nothing_to_copy = None
    assert not cache.copy_down_one() and len(walks) == walked      # looked at again, the walks kept
    host.capacity = host.used_bytes                     # no room even for a snapshot: no walk at all
    cache._copies_ahead.clear()
    assert not cache.copy_down_one() and len(walks) == walked
    host.capacity = 1 << 30
    while cache.copy_down_one():
        pass
    assert all(key in host for key in cache.lru)


def test_the_idle_copy_goes_a_piece_at_a_time(flash, monkeypatch):
    """idle_work copies WRITE_PIECE blocks of an entry a call (a request arriving meanwhile waits for one piece, not a
    whole entry): the blocks stay loose until the snapshot follows the last piece; a host tier over its budget drops
    the loose blocks before any entry; an eviction's write-down takes them up (each block named as often as entries
    name it), the resume from the host tier is exact, and clear() drops loose blocks too."""
    from flashnext.cache import tier_index

    monkeypatch.setattr(tier_index, "WRITE_PIECE", 1)
    engine = make(loaded=flash.loaded, kv_host_gb=0.05, kv_host_write_behind=False)
    a = tokens(8, 70)
    reply, _ = run(engine, a, rid="a")
    run(engine, tokens(9, 60), rid="b")
    cache, host = engine.prefix_cache, engine.prefix_cache.lower
    assert engine.idle_work() and not host.snaps and len(host.loose) == 1
    while not (host.snaps and host.loose):      # one entry whole, the next one begun
        assert engine.idle_work()
    whole = set(host.snaps)
    capacity, host.capacity = host.capacity, host.used_bytes - 1
    host.fit()
    assert not host.loose and set(host.snaps) == whole
    host.capacity = capacity
    assert engine.idle_work() and host.loose                                   # that copy starts over
    cache.evict_all()
    assert not host.loose and cache.num_snapshots == 0
    names = Counter(h for meta in host.snaps.values() for h in meta.blocks)
    assert names == Counter({h: n for h, n in host.block_refs.items()})
    turn2 = a + reply + tokens(10, 4)
    assert run(engine, turn2, rid="a2") == (cold(engine, turn2, 6), len(a) + len(reply) - 1)
    run(engine, tokens(11, 60), rid="c")
    while not host.loose:
        assert engine.idle_work()
    host.clear()
    assert not host.loose and not host.block_refs and host.bytes == 0
    # an unfinished idle copy of a snapshot inside a prefill (its end does not fit the host tier, it does), which
    # its eviction drops: its loose blocks go with it
    from flashnext.cache.cache_entry import read_block, tensor_bytes

    engine = make(loaded=flash.loaded, kv_host_gb=0.05, kv_host_write_behind=False)
    run(engine, tokens(12, 100), rid="d")
    cache, host = engine.prefix_cache, engine.prefix_cache.lower
    inside = next(iter(cache.inside_prefill))
    node, tail = cache.lru[inside]
    host.capacity = len(node.path()) * tensor_bytes(read_block(engine.kv, 0)) + node.snapshots[tail].nbytes
    assert engine.idle_work() and host.loose and not host.snaps
    cache._evict(inside)
    assert not host.loose and host.bytes == 0


def test_disk_restart_corrupt_and_foreign(flash, tmp_path, caplog):
    first = make(loaded=flash.loaded, kv_disk_dir=str(tmp_path), kv_host_gb=0.05, kv_host_write_through=True)
    prompt = tokens(8, 60)
    reply, _ = run(first, prompt)
    turn2 = prompt + reply + tokens(9, 4)
    expected = cold(first, turn2, 6)
    # A new engine on the same directory (a server restart) resumes turn 2 from disk.
    restart_point(first)
    second = make(loaded=flash.loaded, kv_disk_dir=str(tmp_path))
    assert run(second, turn2) == (expected, 65)
    pools_idle(second)
    # A damaged snapshot file is never loaded: the request falls back to a shallower snapshot.
    snaps = sorted((tmp_path / "snapshots").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    for path in snaps:
        data = bytearray(path.read_bytes())
        data[-8:] = bytes(8 - i for i in range(8))
        path.write_bytes(bytes(data))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashnext.cache"):
        third = make(loaded=flash.loaded, kv_disk_dir=str(tmp_path))
        out, cached = run(third, turn2)
    assert out == expected and cached == 0
    assert "fails its checksum" in caplog.text
    # Files of another model are ignored at start.
    run(first, turn2)
    restart_point(first)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashnext.cache"):
        foreign = make("tiny-qwen3-next", kv_disk_dir=str(tmp_path))
    assert "another model" in caplog.text and not foreign.prefix_cache.lower.snaps
    pools_idle(first)


def test_shutdown_keeps_the_latest_conversation_when_the_disk_is_short(flash, tmp_path):
    """A disk budget that holds one conversation but not two: at shutdown the one in use (in VRAM) must be what
    survives, not an older one spilled to host RAM, and the older one is not written at all (persist writes only
    the newest entries that fit)."""
    older, latest = tokens(30, 70), tokens(31, 70)
    sizing = make(loaded=flash.loaded, kv_disk_dir=str(tmp_path / "sizing"))
    run(sizing, older)
    sizing.shutdown()
    one_conversation, entries = disk_tier(sizing).bytes, len(disk_tier(sizing).snaps)
    pools_idle(sizing)

    first = make(loaded=flash.loaded, kv_disk_dir=str(tmp_path / "kv"), kv_host_gb=0.05,
                 kv_disk_gb=1.5 * one_conversation / 2**30)
    replies = {}
    replies["older"], _ = run(first, older, rid="older")
    first.prefix_cache.evict_all()        # the older conversation now sits in the host tier only
    replies["latest"], _ = run(first, latest, rid="latest")
    assert first.prefix_cache.persist() == entries       # the latest conversation's entries, nothing of the older
    first.shutdown()
    second = make(loaded=flash.loaded, kv_disk_dir=str(tmp_path / "kv"))
    for name, prompt in (("latest", latest), ("older", older)):
        turn2 = prompt + replies[name] + tokens(32, 4)
        out, cached = run(second, turn2, rid=name)
        assert out == cold(second, turn2, 6)
        assert (cached >= 64) == (name == "latest"), (name, cached)   # the budget held only one of them
    pools_idle(second)
    pools_idle(first)


def test_a_disk_read_does_not_hold_up_the_other_requests(flash, tmp_path, monkeypatch):
    """A conversation coming back from disk is read in the background: while its files are read, another request
    keeps decoding; then it resumes from the disk entry exactly. A read whose request went away is let go."""
    import threading

    from flashnext.cache.disk_tier import DiskTier

    turn2, expected = turn_two_on_disk(flash, tmp_path, 40)
    second = make(loaded=flash.loaded, kv_disk_dir=str(tmp_path))
    disk = disk_tier(second)
    gate, reading = threading.Event(), threading.Event()
    real_read = DiskTier.read

    def slow_read(self, key, meta):
        reading.set()
        assert gate.wait(30)
        return real_read(self, key, meta)

    monkeypatch.setattr(DiskTier, "read", slow_read)
    other = tokens(42, 30)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    second.add_request("other", other, params)
    second.add_request("back", turn2, params)
    produced = {"other": [], "back": []}
    while len(produced["other"]) < 6:
        for out in second.step():
            produced[out.request_id] += out.token_ids
    assert reading.wait(30) and produced["back"] == []          # the other request finished meanwhile
    assert second.prefix_cache.reading and disk.installing
    from types import SimpleNamespace

    from flashnext.server.metrics import _EngineCollector
    families = {f.name: f for f in _EngineCollector(SimpleNamespace(served_model_name="m"), lambda: second).collect()}
    assert [s.value for s in families["flashnext_prefix_cache_background_reads"].samples] == [1]
    gate.set()
    while second.has_work():
        for out in second.step():
            produced[out.request_id] += out.token_ids
            if out.request_id == "back" and out.finished:
                cached = out.cached_tokens
    assert produced["back"] == expected and cached >= 64
    assert produced["other"] == cold(second, other, 6)
    assert not second.prefix_cache.reading and not disk.installing

    # A read whose request is gone (cancelled while it waited) is let go at once, even with no other work.
    second.prefix_cache.clear()
    second.add_request("gone", turn2, params)
    second.step()                                   # starts the read
    assert second.prefix_cache.reading and disk.installing
    second.abort("gone")
    assert not second.prefix_cache.reading and not disk.installing
    pools_idle(second)


def test_a_request_whose_disk_entry_changes_lets_go_of_its_first_read(flash, tmp_path):
    """While a request waits, a deeper entry of its prompt may reach the disk: its next lookup reads that one, and
    the first read (its host payload, the entry's guard against eviction) is let go, not kept for nobody."""
    first = make(loaded=flash.loaded, kv_disk_dir=str(tmp_path), kv_host_gb=0.05, kv_host_write_through=True)
    prompt = tokens(50, 40)
    reply, _ = run(first, prompt)
    run(first, prompt + reply + tokens(51, 30))   # each turn's end written through: two entries on disk
    restart_point(first)
    pools_idle(first)
    second = make(loaded=flash.loaded, kv_disk_dir=str(tmp_path))
    cache, disk = second.prefix_cache, disk_tier(second)
    shallow, deep = list(disk.snaps)[:2]
    assert cache._read_in_background(disk, shallow, disk.snaps[shallow], "r") is not None
    cache._read_in_background(disk, deep, disk.snaps[deep], "r")
    assert shallow not in cache._reads and shallow not in disk.installing
    assert deep in cache._reads and deep in disk.installing
    cache.forget_read("r")
    assert not cache.reading and not disk.installing
    pools_idle(second)


def test_over_the_snapshot_budget_the_ends_outlive_the_snapshots_inside_prefills(flash):
    # Room for three or four snapshots; each 150-token prompt takes two inside its prefill (64, 128), one at its end
    # and one at its reply's. Oldest first, B's four would push all of A's out; the ones inside prefills go first,
    # so A's reply end is still there for its next turn.
    per_block = flash.kv.bytes_per_block(flash.config, BS, flash.dtype)
    snapshot = flash.states.bytes_per_slot(flash.config, flash.dtype) + per_block
    engine = make(loaded=flash.loaded, prefix_cache_gb=3.5 * snapshot / 2**30)
    a, b = tokens(20, 150), tokens(21, 150)
    reply_a, _ = run(engine, a, rid="a")
    run(engine, b, rid="b")
    turn2 = a + reply_a + tokens(22, 5)
    out, cached = run(engine, turn2, rid="a2")
    assert cached == len(a) + len(reply_a) - 1 and out == cold(engine, turn2, 6)
    pools_idle(engine)


def test_snapshots_inside_a_prefill_are_dropped_not_written_down(flash):
    """Evicted to a host tier, a prompt's snapshots taken inside its prefill that nothing resumed from are dropped (its
    blocks go down with its end's snapshot) and the next turn resumes exactly from the host tier; one that a request
    resumed from is written down like an end, and a third prompt sharing that prefix resumes from it on the host."""
    engine = make(loaded=flash.loaded, kv_host_gb=0.05, kv_host_idle_copy=False, kv_host_write_behind=False)
    a = tokens(20, 150)
    reply_a, _ = run(engine, a, rid="a")
    cache, host = engine.prefix_cache, engine.prefix_cache.lower
    inside = {cache.lru[k][0].snapshots[cache.lru[k][1]].num_tokens for k in cache.inside_prefill}
    ends = {snap.num_tokens for node, tail in cache.lru.values() for snap in [node.snapshots[tail]]} - inside
    assert inside and ends
    cache.evict_all()
    assert {meta.num_tokens for meta in host.snaps.values()} == ends
    turn2 = a + reply_a + tokens(22, 5)
    assert run(engine, turn2, rid="a2") == (cold(engine, turn2, 6), len(a) + len(reply_a) - 1)
    engine2 = make(loaded=flash.loaded, kv_host_gb=0.05, kv_host_idle_copy=False, kv_host_write_behind=False)
    run(engine2, a, rid="a")
    shared = max(t for t in inside if t <= 130)
    b = a[:130] + tokens(23, 20)
    assert run(engine2, b, rid="b") == (cold(engine2, b, 6), shared)       # from the device
    engine2.prefix_cache.evict_all()
    assert shared in {meta.num_tokens for meta in engine2.prefix_cache.lower.snaps.values()}
    d = a[:130] + tokens(24, 20)
    assert run(engine2, d, rid="d") == (cold(engine2, d, 6), shared)       # from the host tier


def drain(engine, limit=5000) -> dict[str, list[int]]:
    """Step until no work is left (at most `limit` steps) → each request's tokens."""
    out: dict[str, list[int]] = {}
    for _ in range(limit):
        if not engine.has_work():
            return out
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    raise AssertionError(f"still working after {limit} steps")


def test_a_failed_install_does_not_resume_from_a_hit_it_evicted(flash):
    """A lower-tier entry deeper than the device's hit that cannot be installed (running requests hold the blocks)
    falls back to the device's hit — which the install's evictions may have taken: it looks again (a KeyError that
    failed every running request, found by fuzzing in session 15)."""
    per_block = flash.kv.bytes_per_block(flash.config, BS, flash.dtype)
    engine = make(loaded=flash.loaded, kv_cache_gb=20 * per_block / 2**30, kv_host_gb=0.05, max_model_len=256,
                  prefix_snapshot_interval=0)
    p = tokens(30, 150)
    run(engine, p, n=1, rid="a")
    engine.prefix_cache.evict_all()                  # a's entry in the host tier only
    run(engine, p[:32], n=1, rid="b")                # a shallower hit on its path, on the device
    engine.add_request("c", tokens(31, 200), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for _ in range(4):                               # c holds most of the 20 blocks
        engine.step()
    d = p + tokens(32, 5)
    engine.add_request("d", d, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert drain(engine)["d"] == cold(engine, d, 3)
    pools_idle(engine)


def test_a_disk_read_waiting_for_room_is_retried_when_blocks_become_evictable(flash, tmp_path):
    """A disk entry read in the background whose install found no room waits until blocks are freed — or given up by
    a finishing request to the cache, which frees none but makes them evictable: the engine had spun without end
    when a request ended on a block boundary (found by fuzzing in session 15)."""
    per_block = flash.kv.bytes_per_block(flash.config, BS, flash.dtype)
    args = dict(kv_cache_gb=32 * per_block / 2**30, kv_disk_dir=str(tmp_path), max_num_batched_tokens=128,
                prefix_snapshot_interval=0)
    p = tokens(40, 150)
    first = make(loaded=flash.loaded, **args)
    run(first, p, n=1, rid="a")
    first.shutdown()                                 # a's entry on disk
    engine = make(loaded=flash.loaded, **args)       # a restart on the same directory
    engine.add_request("c", tokens(41, 440), SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    while not engine.requests["c"].output_ids:      # c decodes, 448 tokens at its end: whole blocks
        engine.step()
    d = p + tokens(42, 5)
    engine.add_request("d", d, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert drain(engine)["d"] == cold(engine, d, 3)


@pytest.mark.parametrize("host_gb", [0.0, 0.0005])
def test_tiny_budgets_stay_exact_and_leak_nothing(flash, host_gb):
    # 24 KV blocks and room for about three snapshots: constant eviction (and spills to a tiny host tier).
    per_block = flash.kv.bytes_per_block(flash.config, BS, flash.dtype)
    snapshot = flash.states.bytes_per_slot(flash.config, flash.dtype) + per_block
    engine = make(loaded=flash.loaded, kv_cache_gb=24 * per_block / 2**30, max_model_len=300,
                  prefix_cache_gb=3.5 * snapshot / 2**30, kv_host_gb=host_gb)
    rng = random.Random(10)
    convs = {i: tokens(100 + i, rng.randrange(20, 70)) for i in range(4)}
    for turn in range(4):
        for i in (turn % 4, (turn + 1) % 4, turn % 4):      # some turns follow their previous one directly
            prompt = convs[i]
            reply, cached = run(engine, prompt, n=4, rid=f"{i}.{turn}")
            assert reply == cold(engine, prompt, 4), (i, turn)
            convs[i] = prompt + reply + tokens(1000 * turn + i, rng.randrange(1, 12))
    assert engine.stats().prefix_hits > 0
    pools_idle(engine)


@pytest.mark.parametrize("host_gb", [0.0, 0.05])
def test_shutdown_persists_to_disk(flash, tmp_path, host_gb):
    """Without write-through, a conversation held only in VRAM (or spilled to host RAM) reaches the disk tier at
    shutdown, and a restarted engine resumes it from there exactly."""
    first = make(loaded=flash.loaded, kv_disk_dir=str(tmp_path), kv_host_gb=host_gb)
    prompt = tokens(20, 70)
    reply, _ = run(first, prompt)
    turn2 = prompt + reply + tokens(21, 4)
    expected = cold(first, turn2, 6)
    if host_gb:
        first.prefix_cache.evict_all()          # the entries now sit in the host tier only
    disk = disk_tier(first)
    assert not disk.snaps       # nothing written down before the shutdown
    first.shutdown()            # persist waits for the disk writer too
    assert disk.snaps
    second = make(loaded=flash.loaded, kv_disk_dir=str(tmp_path))
    out, cached = run(second, turn2)
    assert out == expected and cached >= 64
    pools_idle(second)
    pools_idle(first)


def test_conversations_resumed_in_turn_keep_their_ends_under_the_default_budget(flash):
    # The H200's `bench concurrency` (session 13): 8 conversations prefilled and answered together, then each
    # resumed in turn from its history's end (a chat template renders the reply anew, so the reply-end snapshot
    # does not lie on the next prompt). With room for ~9 snapshots (the old fixed 1 GiB), the first resumes
    # missed and each miss's new end pushed out the next conversation's: none hit. The default budget holds
    # three snapshots a sequence slot.
    n, length = 8, 200
    engine = make(loaded=flash.loaded, max_num_seqs=n)
    prompts = [tokens(100 + i, length) for i in range(n)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def together(requests):
        for rid, prompt in requests:
            engine.add_request(rid, prompt, params)
        outs = {}
        while engine.has_work():
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
        return {rid: outs[rid][-1].cached_tokens for rid, _ in requests}

    together([(f"a{i}", p) for i, p in enumerate(prompts)])
    cached = together([(f"b{i}", p + tokens(300 + i, 30)) for i, p in enumerate(prompts)])
    assert cached == {f"b{i}": length for i in range(n)}
    per_snapshot = engine.memory_plan.state_bytes // n + engine.kv.bytes_per_block(engine.config, BS, engine.dtype)
    assert engine.prefix_cache.snapshot_budget == 3 * n * per_snapshot


def test_the_default_snapshot_budget_is_cut_to_the_free_memory():
    from flashnext.engine.llm_engine import fit_snapshot_budget

    gib = 1 << 30
    assert fit_snapshot_budget(5 * gib, free=20 * gib, reserve=2 * gib, activations=3 * gib) == 5 * gib
    assert fit_snapshot_budget(5 * gib, free=8 * gib, reserve=2 * gib, activations=3 * gib) == 3 * gib
    assert fit_snapshot_budget(5 * gib, free=4 * gib, reserve=2 * gib, activations=3 * gib) == 0
