"""Tensor and expert parallel on 2 CPU processes (gloo) equal one process: logits of a 100-token prompt and of
16 greedy decode steps (fp32, rel 1e-5, same tokens), and the engine at tensor_parallel=2 generates the
same greedy tokens as at world size 1 — also when later turns come back from the prefix cache's device, host
or disk tier, which every rank keeps its own share of."""
import dataclasses
import os

import pytest
import torch

from flashnext.engine.loading import load_model
from flashnext.models.session import Session
from oracle import rel_err

PRESETS = ["tiny-flash-next", "tiny-qwen3-next"]
LAYOUTS = [(2, 1), (1, 2), (2, 2)]   # (tensor parallel, expert parallel)
DECODE = 16
TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Spawned ranks inherit the environment: one thread each, so two ranks fit two cores.
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("OMP_NUM_THREADS")
    else:
        os.environ["OMP_NUM_THREADS"] = old


def _prompt():
    return torch.randint(3, 480, (100,), generator=torch.Generator().manual_seed(0))


def _greedy(model):
    """Prompt logits [100, V], then DECODE greedy steps: their logits [DECODE, V] and tokens."""
    s = Session(model, 128)
    prompt_logits = s.extend(_prompt(), all_logits=True)
    logits, steps, tokens = prompt_logits[-1], [], []
    for _ in range(DECODE):
        tokens.append(int(logits.argmax()))
        logits = s.extend([tokens[-1]])
        steps.append(logits)
    return prompt_logits, torch.stack(steps), tokens


def _rank(rank, world, preset, out_path):
    """Every layout in one process group: rank 0 drives Sessions, rank 1 follows in the worker loop."""
    from flashnext.parallel.runtime import ParallelPlan, attach_broadcaster, send_stop, worker_loop

    torch.set_num_threads(1)
    results = {}
    for tp, ep in LAYOUTS:
        loaded = load_model(preset, "cpu", torch.float32, parallel=ParallelPlan(rank, world, tp, ep))
        if rank == 0:
            hook = attach_broadcaster(loaded.model)
            results[(tp, ep)] = _greedy(loaded.model)
            hook.remove()
            send_stop(torch.device("cpu"))
        else:
            worker_loop(loaded.model, torch.float32, torch.device("cpu"))
    if rank == 0:
        torch.save(results, out_path)


@pytest.mark.parametrize("preset", PRESETS)
def test_parallel_equals_single_process(preset, tmp_path):
    from flashnext.parallel import spawn_ranks

    torch.set_num_threads(1)
    want_prompt, want_steps, want_tokens = _greedy(load_model(preset, "cpu", torch.float32).model)
    spawn_ranks(_rank, 2, preset, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    for layout, (prompt_logits, step_logits, tokens) in got.items():
        assert rel_err(prompt_logits, want_prompt) < TOL, layout
        assert tokens == want_tokens, layout
        assert rel_err(step_logits, want_steps) < TOL, layout


def test_shard_refuses_uneven_heads():
    from flashnext.engine.loading import resolve_model
    from flashnext.parallel.shard import check_divisible
    from flashnext.weights.config import load_config

    cfg = load_config(resolve_model("tiny-qwen3-next"))
    with pytest.raises(ValueError, match="num_key_value_heads = 2"):
        check_divisible(cfg, 4, 1)
    with pytest.raises(ValueError, match="num_experts = 8"):
        check_divisible(cfg, 1, 3)


def _world_1_and_2(run, args: dict, **layout):
    """run(engine) on one process and on two ranks laid out as `layout` → (world 1's result, world 2's)."""
    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine
    from flashnext.parallel import launch_engine, shutdown

    want = run(LLMEngine(EngineArgs(**args)))
    try:
        return want, run(launch_engine(EngineArgs(**args, **layout)))
    finally:
        shutdown()


def test_engine_tensor_parallel_same_tokens():
    """The engine at tensor_parallel=2 equals world 1, with the prefix cache on: a second turn of each
    conversation resumes from snapshots that every rank took of its own heads (parallel/mirror.py)."""
    from flashnext.engine.sampling_params import SamplingParams

    prompts = [[(7 * i + 3 * j) % 470 + 3 for j in range(n)] for i, n in enumerate((5, 40, 23))]

    def turn(engine, prompts, tag):
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        out, cached = {f"{tag}{i}": [] for i in range(len(prompts))}, {}
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.token_ids
                cached[o.request_id] = o.cached_tokens
        return [out[f"{tag}{i}"] for i in range(len(prompts))], cached

    def run(engine):
        first, _ = turn(engine, prompts, "a")
        second, cached = turn(engine, [p + r + [11, 12, 13] for p, r in zip(prompts, first)], "b")
        assert sum(cached.values()) > 0, "the second turn should hit the prefix cache"
        return first, second

    args = dict(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=24,
                max_model_len=256)
    want, got = _world_1_and_2(run, args, tensor_parallel=2)
    assert got == want


@pytest.mark.parametrize("layout", [dict(tensor_parallel=2), dict(expert_parallel=2)])
def test_engine_graph_decode_across_ranks(layout, monkeypatch):
    """The fixed-shape decode step (engine/cuda_graph.py; on a CPU it runs uncaptured) across ranks: rank 0
    announces each graph step, every worker runs its own (parallel/runtime.py broadcast_decode); tokens equal
    world 1's eager engine, with mixed graph/prefill steps and the prefix cache on."""
    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine
    from flashnext.engine.sampling_params import SamplingParams
    from flashnext.parallel import launch_engine, shutdown

    prompts = [[(5 * i + 7 * j) % 470 + 3 for j in range(n)] for i, n in enumerate((6, 31, 17))]

    def run(engine):
        out = {str(i): [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):     # staggered: later prompts enter while earlier ones decode
            engine.add_request(str(i), p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
            for o in engine.step():
                out[o.request_id] += o.token_ids
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.token_ids
        return out

    args = dict(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                max_model_len=256)
    want = run(LLMEngine(EngineArgs(**args)))
    monkeypatch.setattr(LLMEngine, "_use_cuda_graphs", lambda self: True)
    try:
        engine = launch_engine(EngineArgs(**args, **layout))
        got = run(engine)
        assert engine.runner.graphs.graphs, "decode steps should have gone through the graph path"
    finally:
        shutdown()
    assert got == want


def test_engine_expert_parallel_with_expert_cache():
    """Each rank caches its own INT4 experts in a few device slots (--expert-vram-gb per GPU): EP=2 generates
    world 1's all-resident tokens."""
    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine
    from flashnext.engine.sampling_params import SamplingParams
    from flashnext.models.layers.int4_experts import Int4Experts
    from flashnext.parallel import launch_engine, shutdown

    prompts = [[(5 * i + 7 * j) % 470 + 3 for j in range(n)] for i, n in enumerate((9, 31))]

    def run(engine):
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        out = {str(i): [] for i in range(len(prompts))}
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.token_ids
        return out

    args = dict(model="tiny-qwen3-next", device="cpu", dtype="float32", quantize="int4", max_num_seqs=4,
                max_num_batched_tokens=32, max_model_len=128)
    resident = LLMEngine(EngineArgs(**args))
    sets = [m for m in resident.loaded.model.modules() if isinstance(m, Int4Experts)]
    per_expert = sum(b[0].numel() * b.element_size() for b in sets[0].buffers(recurse=False))
    want = run(resident)
    try:
        engine = launch_engine(EngineArgs(**args, expert_parallel=2,
                                          expert_vram_gb=2 * len(sets) * per_expert / 2**30))
        assert engine.loaded.expert_cache is not None and engine.loaded.expert_cache.slots_per_layer == 2
        got = run(engine)
        assert engine.loaded.expert_cache.stats.misses > 0
    finally:
        shutdown()
    assert got == want


def _prompt_logits_from_ranks(rank, model, out_path):
    """Rank 0 saves the prompt logits of a Session over the sharded model; the other ranks follow it."""
    from flashnext.parallel.runtime import attach_broadcaster, send_stop, worker_loop

    if rank == 0:
        attach_broadcaster(model)
        torch.save(Session(model, 128).extend(_prompt(), all_logits=True), out_path)
        send_stop(torch.device("cpu"))
    else:
        worker_loop(model, torch.float32, torch.device("cpu"))


def _rank_int4(rank, world, out_path, model_name, quantize, tp, ep):
    from flashnext.models.layers.int4_experts import Int4Experts
    from flashnext.models.layers.int4_linear import Int4Linear
    from flashnext.parallel.runtime import ParallelPlan

    torch.set_num_threads(1)
    model = load_model(model_name, "cpu", torch.float32, quantize=quantize,
                       parallel=ParallelPlan(rank, world, tp, ep)).model
    # the rank holds its share of the experts, packed (that only the share is read from the checkpoint is
    # test_weights_checkpoint's test_expert_range_reads_only_that_share)
    shares = {m.num_experts for m in model.modules() if isinstance(m, Int4Experts)}
    assert shares == {model.cfg.num_experts // ep}, shares
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    _prompt_logits_from_ranks(rank, model, out_path)


# (--quantize int4 with tensor parallel rounds each rank's share: the tiny models' small projections get other
# groups than unsplit, so it is not exact there; a packed checkpoint's groups are fixed.)
@pytest.mark.parametrize("source,tp,ep", [("--quantize int4", 1, 2), ("int4 checkpoint", 1, 2),
                                          ("int4 checkpoint", 2, 1), ("int4 checkpoint", 2, 2),
                                          ("int4-ct checkpoint", 2, 2)])
def test_parallel_int4(source, tp, ep, tmp_path):
    """INT4 across ranks equals one process exactly, whether the model was quantised after loading (and
    sharding) or read packed from a GPTQ or compressed-tensors checkpoint: whole experts on their rank (each rank reading only its
    share), packed projections cut by output rows, and by whole input groups for the row-parallel ones."""
    from flashnext.parallel import spawn_ranks
    from flashnext.weights.synth import synthesize

    torch.set_num_threads(1)
    name, quantize = "tiny-qwen3-next", "int4"
    if source.endswith("checkpoint"):
        kind = source.split()[0]
        name, quantize = str(synthesize("tiny-qwen3-next", tmp_path / kind, dtype=kind)), None
    want = Session(load_model(name, "cpu", torch.float32, quantize=quantize).model, 128).extend(
        _prompt(), all_logits=True)
    spawn_ranks(_rank_int4, 2, str(tmp_path / "out.pt"), name, quantize, tp, ep)
    assert rel_err(torch.load(tmp_path / "out.pt"), want) < TOL


def test_tensor_parallel_refuses_int4_groups_across_ranks(tmp_path):
    """tiny-flash-next's GatedDeltaNet out_proj has 96 inputs in groups of 32: 48 per rank would cut a group."""
    from flashnext.parallel.runtime import ParallelPlan
    from flashnext.weights.synth import synthesize

    folder = synthesize("tiny-flash-next", tmp_path / "int4", dtype="int4")
    with pytest.raises(ValueError, match=r"tensor parallel 2 cannot split an int4 projection's 96 inputs \(group "
                                         r"size 32\).*use --expert-parallel"):
        load_model(str(folder), "cpu", torch.float32, parallel=ParallelPlan(0, 2, 2, 1))


def _rank_shared_ple(rank, world, out_path, share):
    from flashnext.models.layers.row_table import RowTable
    from flashnext.parallel.runtime import ParallelPlan

    torch.set_num_threads(1)
    model = load_model("tiny-flash-next", "cpu", torch.float32, ple_placement="host",
                       parallel=ParallelPlan(rank, world, 2, 1, share)).model
    tables = [m.weight for m in model.modules() if isinstance(m, RowTable) and m.placement == "host"]
    assert tables and all(t.untyped_storage().filename == share for t in tables), "not the shared mapping"
    _prompt_logits_from_ranks(rank, model, out_path)


def test_ranks_share_one_host_ple_table(tmp_path):
    """Rank 0 reads the host-placed PLE table into a shared file mapping, rank 1 maps the same file instead of
    reading its own copy; the files are gone once both have it, and TP=2 still equals one process."""
    from flashnext.parallel import spawn_ranks
    from flashnext.weights.shared_table import share_path

    torch.set_num_threads(1)
    want = Session(load_model("tiny-flash-next", "cpu", torch.float32, ple_placement="host").model, 128).extend(
        _prompt(), all_logits=True)
    share = str(share_path(tmp_path / "shm", os.getpid(), 1))
    spawn_ranks(_rank_shared_ple, 2, str(tmp_path / "out.pt"), share)
    assert rel_err(torch.load(tmp_path / "out.pt"), want) < TOL
    assert not list((tmp_path / "shm").iterdir())


def test_ple_share_dir_off_keeps_a_copy_per_rank():
    import argparse

    from flashnext.engine.args import EngineArgs
    from flashnext.parallel.launch import _plan
    from flashnext.server.serve import add_serve_arguments, engine_args_from

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = engine_args_from(parser.parse_args(["--model", "tiny-flash-next", "--ple-share-dir", "off"]))
    assert args.ple_share_dir == "off" and _plan(dataclasses.replace(args, tensor_parallel=2), 0, 1).ple_share is None
    assert _plan(EngineArgs(tensor_parallel=2), 0, 1).ple_share.startswith("/dev/shm/flashnext-ple-")


def test_ple_share_falls_back_to_a_copy_per_rank_without_room(tmp_path, monkeypatch, caplog):
    import logging
    from collections import namedtuple

    from flashnext.weights import shared_table

    statvfs = namedtuple("statvfs", "f_bavail f_frsize")
    monkeypatch.setattr(shared_table.os, "statvfs", lambda path: statvfs(1, 4096))
    path = tmp_path / "flashnext-ple-1-2"
    with caplog.at_level(logging.WARNING, logger="flashnext.weights"):
        rank0 = shared_table.TableShare(path, "t", (1000, 8), torch.float32, 0, 2).begin()
    assert rank0 == ({}, frozenset()) and "every rank keeps its own copy" in caplog.text
    assert shared_table.TableShare(path, "t", (1000, 8), torch.float32, 1, 2, timeout_s=1).begin() == ({}, frozenset())


# ---- the prefix cache's host and disk tiers across ranks (parallel/mirror.py) ----
PROMPT, REPLY = 70, 4
TURN2_HIT = PROMPT + REPLY - 1      # turn 2 resumes after all but the last reply token


def _tier_args(**kw):
    """8 KV blocks of 16 tokens (the floor for max_model_len 128): two conversations of PROMPT tokens do not
    fit, so each one's admission moves the other's snapshots down a tier."""
    from flashnext.cache.kv_pool import KVPool
    from flashnext.engine.loading import resolve_model
    from flashnext.weights.config import load_config

    per_block = KVPool.bytes_per_block(load_config(resolve_model("tiny-flash-next")), 16, torch.float32)
    return dict(model="tiny-flash-next", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=128,
                max_model_len=128, kv_cache_gb=per_block / 2**30, **kw)


def _turns(engine, convs, tag, tier_loads=None):
    """One turn of each conversation, one after the other: (replies, cached tokens); counts the loads from
    rank 0's tier `tier_loads` names ("host", "disk")."""
    from flashnext.engine.sampling_params import SamplingParams

    loads = []
    tier = engine.prefix_cache.lower
    while tier is not None and tier_loads is not None:
        if tier.name == tier_loads:
            tier.load = lambda key, load=tier.load: loads.append(key) or load(key)
        tier = tier.lower
    replies, cached = [], []
    for i, prompt in enumerate(convs):
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(max_tokens=REPLY, temperature=0, ignore_eos=True))
        out = []
        while engine.has_work():
            out += engine.step()
        replies.append([t for o in out for t in o.token_ids])
        cached.append(out[-1].cached_tokens)
    return replies, cached, len(loads)


def _conversations():
    return [[(11 * i + 5 * j) % 470 + 3 for j in range(PROMPT)] for i in range(2)]


def _next_turn(convs, replies):
    return [c + r + [21, 22, 23] for c, r in zip(convs, replies)]


def test_engine_host_tier_across_ranks():
    """TP=2 with a KV pool too small for two conversations: their snapshots go to host RAM and come back for
    turn 2 on every rank (each rank its own heads) — the same tokens and cached tokens as world 1."""
    def run(engine):
        convs = _conversations()
        first, _, _ = _turns(engine, convs, "a")
        second, cached, host_loads = _turns(engine, _next_turn(convs, first), "b", "host")
        assert host_loads == 2 and cached == [TURN2_HIT] * 2, (host_loads, cached)
        return first, second

    want, got = _world_1_and_2(run, _tier_args(kv_host_gb=0.05), tensor_parallel=2)
    assert got == want


def test_engine_disk_tier_across_ranks_survives_restart(tmp_path, caplog):
    """TP=2 with host and disk tiers: the first engine spills through a tiny host tier to disk and persists the
    rest at shutdown, every rank under its own rank<r>/; a new engine on the same directory resumes turn 2
    from disk exactly as world 1 does. A rank's damaged share is caught by that rank (the entry is dropped
    everywhere, the turn is computed), and rank 0 ignores entries whose other shares are missing or were
    written by another parallel layout."""
    import logging
    import shutil

    from flashnext.cache.cache_entry import chain_hashes, snapshot_key
    from flashnext.cache.disk_tier import DiskTier, disk_stores, model_identity
    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine
    from flashnext.parallel import launch_engine, shutdown

    def deepest_key(tokens, n):
        """The name of the snapshot after tokens[:n]."""
        return snapshot_key(chain_hashes(tokens, 16, n // 16)[-1], tokens[n // 16 * 16:n])

    def first_engine(engine):
        convs = _conversations()
        first, _, _ = _turns(engine, convs, "a")
        engine.shutdown()                # persist: what the device and host tiers hold goes to disk
        return convs, first

    one, two = tmp_path / "world1", tmp_path / "world2"
    host = 0.00005                       # about one snapshot: the other one spills on to disk
    convs, first = first_engine(LLMEngine(EngineArgs(**_tier_args(kv_host_gb=host, kv_disk_dir=str(one)))))
    want, cached, _ = _turns(LLMEngine(EngineArgs(**_tier_args(kv_disk_dir=str(one)))), _next_turn(convs, first), "b")
    assert cached == [TURN2_HIT] * 2

    try:
        engine = launch_engine(EngineArgs(**_tier_args(kv_host_gb=host, kv_disk_dir=str(two), tensor_parallel=2)))
        identity = model_identity(engine.loaded.path, torch.float32, 16)
        assert first_engine(engine) == (convs, first)
    finally:
        shutdown()
    names = [sorted(p.name for p in (two / f"rank{r}" / sub).iterdir()) for r in range(2)
             for sub in ("batches", "snapshots")]
    assert names[0] and names[1] and names[:2] == names[2:], "rank 1 must hold a share of every entry of rank 0"
    held = [set(store.rows) for store in disk_stores(two, identity, 2, 1)]
    assert held[0] and held[0] == held[1]

    # Rank 0 checks every rank's share at start: another layout's files, or one rank's missing file, are ignored.
    copy = tmp_path / "copy"
    shutil.copytree(two, copy)
    (copy / "rank1" / "snapshots" / f"{deepest_key(convs[0] + first[0], TURN2_HIT).hex()}.safetensors").unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashnext.cache"):
        stores = disk_stores(copy, identity, 2, 1)
        assert len(DiskTier(stores[0], 1 << 30, 16, peers=stores[1:]).snaps) == len(names[1]) - 1
        assert "another rank's share is not there" in caplog.text
        assert not DiskTier(disk_stores(copy, identity, 1, 2)[0], 1 << 30, 16).snaps
        assert "another model, layout or format version" in caplog.text

    # Rank 1's share of conversation 1's deepest snapshot is damaged: only rank 1 can tell.
    damaged = two / "rank1" / "snapshots" / f"{deepest_key(convs[1] + first[1], TURN2_HIT).hex()}.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-8:] = bytes(8 - i for i in range(8))
    damaged.write_bytes(bytes(data))
    caplog.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="flashnext.cache"):
            engine = launch_engine(EngineArgs(**_tier_args(kv_disk_dir=str(two), tensor_parallel=2)))
            got, cached, disk_loads = _turns(engine, _next_turn(convs, first), "b", "disk")
    finally:
        shutdown()
    assert got == want
    assert cached == [TURN2_HIT, 0] and disk_loads == 2
    assert "another rank cannot read its share" in caplog.text


def test_a_dead_worker_ends_the_server_instead_of_hanging_it():
    # Without the watch, rank 0's next collective would wait for the killed rank for ever.
    import subprocess
    import sys

    script = """
import logging, os, signal, time
logging.basicConfig(level=logging.INFO)
from flashnext.engine.args import EngineArgs
from flashnext.parallel import launch
engine = launch.launch_engine(EngineArgs(model="tiny-qwen3-next", device="cpu", dtype="float32", max_num_seqs=2,
                                         max_model_len=128, tensor_parallel=2))
os.kill(launch._started[-1][0][0].pid, signal.SIGKILL)
time.sleep(60)
print("still running")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "flashnext-rank1 exited with code -9" in out.stderr and "still running" not in out.stdout
