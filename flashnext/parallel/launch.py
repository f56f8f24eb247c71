"""`launch_engine(args)`: the engine over several GPUs of one host, started from one process.

The calling process becomes rank 0 (scheduler, sampling, server); it spawns one worker process per other
rank (torch.multiprocessing, spawn), every rank loads and shards the model itself, and the workers then sit
in `worker_loop` until rank 0 exits. `spawn_ranks` is the same start-up for code that drives every rank
itself (tests, scripts/gpu_parallel.py).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.tier_index import TierStore
from flashnext.engine.args import EngineArgs, resolve_dtype
from flashnext.engine.loading import load_model
from flashnext.parallel.mirror import SnapshotMirror, WorkerCache
from flashnext.parallel.runtime import (ParallelPlan, attach_broadcaster, attach_decode_announcer, free_port,
                                        init_process, rank_device, send_ops, send_stop, worker_loop, world_size)

log = logging.getLogger("flashnext.parallel")
# (workers, rank 0's device, its SnapshotMirror, their watch's stop event, its decode graphs) of the engine this
# process launched
_started: list = []
WATCH_INTERVAL_S = 0.5


def _plan(args: EngineArgs, rank: int, port: int) -> ParallelPlan:
    share = None
    if args.ple_share_dir != "off":
        from flashnext.weights.shared_table import share_path

        rank0_pid = os.getpid() if rank == 0 else os.getppid()   # rank 0 spawned the workers
        share = str(share_path(args.ple_share_dir, rank0_pid, port))
    return ParallelPlan(rank, world_size(args.tensor_parallel, args.expert_parallel), args.tensor_parallel,
                        args.expert_parallel, share)


def _load(args: EngineArgs, rank: int, port: int):
    plan = _plan(args, rank, port)
    device = rank_device(args.device, rank)
    init_process(rank, plan.world, port, device)
    dtype = resolve_dtype(args.dtype, device, args.model)
    # --expert-vram-gb is per GPU: each rank caches its own experts (all of them with tensor parallel alone).
    loaded = load_model(args.model, device, dtype, quantize=args.quantize, parallel=plan, ple_placement=args.ple_placement,
                        expert_vram_gb=args.expert_vram_gb, expert_cache_policy=args.expert_cache_policy,
                        expert_prefetch=args.expert_prefetch)
    return loaded, device, dtype


def _tier_stores(args: EngineArgs, loaded, dtype, rank: int) -> list[TierStore]:
    """This rank's stores for the prefix cache's lower tiers, in the order of rank 0's tiers
    (LLMEngine._build_prefix_cache: host above disk)."""
    if not args.enable_prefix_caching:
        return []
    stores = []
    if args.kv_host_gb > 0:
        from flashnext.cache.host_tier import HostStore

        stores.append(HostStore(int(args.kv_host_gb * (1 << 30))))
    if args.kv_disk_dir:
        from flashnext.cache.disk_tier import disk_stores, model_identity

        identity = model_identity(loaded.path, dtype, KVPool.fit_block_size(loaded.config, args.block_size))
        stores.append(disk_stores(args.kv_disk_dir, identity, args.tensor_parallel, args.expert_parallel)[rank])
    return stores


def _worker(rank: int, args: EngineArgs, port: int) -> None:
    # Ctrl-C reaches the whole process group: rank 0 alone handles it and then tells the workers to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loaded, device, dtype = _load(args, rank, port)
    if args.routing_trace:  # the same seeds as rank 0's: every rank routes alike
        from flashnext.cache.routing_trace import install_routing_trace

        install_routing_trace(loaded.model, args.routing_trace, args.seed)
    keeper = None
    if loaded.expert_cache is not None and device.type == "cuda":
        # decode steps read the pools through their slot tables, as rank 0's (LLMEngine), and the keeper, told
        # around each step (DecodeGraphs.keeper), adapts this rank's pools as rank 0's keeper does its own
        keeper = loaded.expert_cache.enable_graphs()
    if args.warmup:   # rank 0's warm-up compiles these outside any forward the workers follow (LLMEngine.warm_up)
        from flashnext.engine.args import model_len
        from flashnext.models.layers.qsa_indexer import compile_selection_kernels

        compile_selection_kernels(loaded.config, device, model_len(args, loaded.config))
    steps = worker_loop(loaded.model, dtype, device, WorkerCache(_tier_stores(args, loaded, dtype, rank)), keeper)
    log.debug("rank %d: %d forwards, stopping", rank, steps)
    dist.destroy_process_group()


def launch_engine(args: EngineArgs):
    """An LLMEngine whose model spans `max(tensor_parallel, expert_parallel)` devices; world size 1 is the plain
    engine. The prefix cache works across ranks, its host and disk tiers included: rank 0's cache decides and
    every rank keeps its own share of each entry (parallel/mirror.py)."""
    from flashnext.engine.llm_engine import LLMEngine

    world = world_size(args.tensor_parallel, args.expert_parallel)
    if world == 1:
        return LLMEngine(args)
    device = rank_device(args.device, 0)
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"--tensor-parallel/--expert-parallel {world} needs {world} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    args = dataclasses.replace(args, device=str(device))
    port = free_port()
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_worker, args=(rank, args, port), daemon=True, name=f"flashnext-rank{rank}")
               for rank in range(1, world)]
    for w in workers:
        w.start()
    stop_watch = threading.Event()
    threading.Thread(target=_watch, args=(workers, stop_watch), daemon=True, name="flashnext-rank-watch").start()
    try:
        loaded, device, _ = _load(args, 0, port)
        mirror = SnapshotMirror(send_ops)
        attach_broadcaster(loaded.model, mirror)
        engine = LLMEngine(args, loaded=loaded)
    except BaseException:
        stop_watch.set()
        for w in workers:
            w.terminate()
        raise
    if engine.prefix_cache is not None:
        mirror.attach(engine.prefix_cache)
    if engine.runner.graphs is not None:
        attach_decode_announcer(engine.runner.graphs, mirror)
    _started.append((workers, device, mirror, stop_watch, engine.runner.graphs))
    atexit.register(shutdown)
    log.info("rank 0 of %d (tensor parallel %d, expert parallel %d); workers %s", world, args.tensor_parallel,
             args.expert_parallel, [w.pid for w in workers])
    return engine


def shutdown(timeout: float = 30.0) -> None:
    """Rank 0: tell the workers to leave their loop, wait for them, leave the group (also run at exit)."""
    while _started:
        workers, device, mirror, stop_watch, graphs = _started.pop()
        stop_watch.set()
        if dist.is_initialized():
            mirror.sync()    # e.g. what LLMEngine.shutdown just wrote down to disk: the workers write theirs
            send_stop(device)
            if graphs is not None:
                graphs.release()   # the workers release theirs at the stop (DecodeGraphs.release says why)
            # Before joining: NCCL's teardown waits for every rank, and the workers are in theirs now (joining
            # first deadlocked on the H200s until the join timed out, then hung on the terminated rank).
            dist.destroy_process_group()
        for w in workers:
            w.join(timeout)
            if w.is_alive():
                w.terminate()
    if dist.is_initialized():  # launch_engine failed before its workers were recorded
        dist.destroy_process_group()


def _watch(workers: list, stop: threading.Event) -> None:
    """Rank 0: a worker that dies (killed, out of memory, failed to load) leaves every other rank waiting in
    its next collective for ever — a server that hangs instead of failing. End the process instead, so that
    a supervisor restarts it; the disk tier is not written (the dead rank's share is gone anyway)."""
    while not stop.wait(WATCH_INTERVAL_S):
        dead = [w for w in workers if w.exitcode is not None]
        if dead:
            log.critical("%s exited with code %s while serving; the other ranks cannot go on without it: exiting",
                         dead[0].name, dead[0].exitcode)
            logging.shutdown()
            os._exit(1)


def _run_rank(rank: int, world: int, port: int, device: str, fn, fn_args) -> None:
    init_process(rank, world, port, rank_device(device, rank))
    try:
        fn(rank, world, *fn_args)
        # every rank done with its collectives before any tears the group down; a rank that failed skips it, and
        # spawn then terminates the others
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    if device == "cpu":
        # All done: leave without gloo's teardown, which now and then aborted a rank whose work had finished
        # ("terminate called without an active exception": fresh-clone CI runs in sessions 10 and 11, the second
        # after the barrier above was added), failing a test that had passed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def spawn_ranks(fn, world: int, *fn_args, device: str = "cpu") -> None:
    """Run `fn(rank, world, *fn_args)` in `world` fresh processes that have joined one group (gloo on CPU,
    NCCL with NVLS off on GPUs); raises if any rank fails."""
    mp.start_processes(_run_rank, args=(world, free_port(), device, fn, fn_args), nprocs=world, join=True,
                       start_method="spawn")
