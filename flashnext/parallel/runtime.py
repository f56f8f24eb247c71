"""Process groups and the one message of the parallel engine: "run this step".

Rank 0 owns the scheduler and the pools' bookkeeping. A forward pre-hook on its model broadcasts every
forward's tokens and segments (slot, rows, computed length, KV block ids) before running it; the other ranks
sit in `worker_loop`, rebuild the same ForwardContext over their own pools (same block and slot numbers, local
heads only) and run the same forward, so every collective inside the model meets its partner. Sampling
happens on rank 0 alone: logits are whole there (lm_head is replicated). A decode step that replays rank 0's
CUDA graph (engine/cuda_graph.py) is announced the same way, as a DECODE message with the graph step's inputs
and block-table changes: each worker replays its own graph of the same bucket (captured at the same moment, so
the warm-ups' all-reduces meet and the NCCL kernels are recorded in both). The prefix cache's ops ride on the
step message; the few that rank 0 needs done and answered before it goes on (parallel/mirror.py) go alone,
followed by one all-reduce of "did it work".
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.state_pool import StatePool
from flashnext.models.context import ForwardContext, Segment
from flashnext.parallel.mirror import SnapshotMirror, WorkerCache

log = logging.getLogger("flashnext.parallel")

STOP, STEP, OPS, DECODE = 0, 1, 2, 3
_HEADER = 9        # cmd, tokens, segments, block ids, pool id, pool blocks, block size, pool slots, cache ops
# DECODE uses the header's segment and block-id fields for its block-table changes and their block ids.
_DECODE_FIXED = 5  # bucket width, graphs' max batch, max width, scratch slot, scratch block
_DELTA = 4         # slot, reset, first row, number of block ids
_SEGMENT = 5       # slot, start, length, context_len, number of block ids
_POOLS_KEPT = 4    # pool pairs a worker keeps (an engine has one; tests open a few Sessions)


@dataclass(frozen=True)
class ParallelPlan:
    rank: int
    world: int
    tp: int = 1
    ep: int = 1
    ple_share: str | None = None   # the file through which the ranks share a host PLE table (weights/shared_table.py)


def world_size(tp: int, ep: int) -> int:
    """Both kinds run over the same ranks: tp and ep are each 1 or the world size."""
    world = max(tp, ep)
    if tp < 1 or ep < 1 or tp not in (1, world) or ep not in (1, world):
        raise ValueError(f"--tensor-parallel {tp} and --expert-parallel {ep}: each must be 1 or the same number "
                         "(the GPUs used)")
    return world


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> torch.device:
    """`cuda` (or auto with a GPU) → this rank's GPU; anything else as given."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    d = torch.device(device)
    return torch.device("cuda", rank) if d.type == "cuda" else d


def init_process(rank: int, world: int, port: int, device: torch.device) -> None:
    """Join the group: NCCL between GPUs, gloo on CPU. NVLink multicast (NVLS) stays off: it is set before
    NCCL reads its environment, in every rank."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=device)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _broadcast(t: torch.Tensor) -> torch.Tensor:
    dist.broadcast(t, src=0)
    return t


def send_stop(device: torch.device) -> None:
    header = torch.zeros(_HEADER, dtype=torch.long, device=device)
    header[0] = STOP
    _broadcast(header)


def _pool_key(kv: KVPool, states: StatePool) -> list[int]:
    return [id(kv), kv.num_blocks, kv.block_size, states.num_slots]


def send_ops(ops: list[int], kv: KVPool, states: StatePool) -> bool:
    """Rank 0: every rank replays these prefix cache ops on its twin of (kv, states) now; True when all could."""
    device = kv.device
    _broadcast(torch.tensor([OPS, 0, 0, 0, *_pool_key(kv, states), len(ops)], dtype=torch.long, device=device))
    _broadcast(torch.tensor(ops, dtype=torch.long, device=device))
    ok = torch.ones(1, dtype=torch.long, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def broadcast_step(input_ids: torch.Tensor, ctx: ForwardContext, mirror: SnapshotMirror | None = None) -> None:
    """Rank 0: tell the workers which forward comes next, and what the prefix cache did since the last one."""
    device = input_ids.device
    segs = ctx.segments
    table = [[s.slot, s.start, s.length, s.context_len, s.blocks.numel()] for s in segs]
    blocks = [s.blocks.to(device=device, dtype=torch.long) for s in segs]
    n_blocks = sum(b.numel() for b in blocks)
    ops = mirror.flush() if mirror is not None else []
    header = torch.tensor([STEP, input_ids.numel(), len(segs), n_blocks, *_pool_key(ctx.kv, ctx.states), len(ops)],
                          dtype=torch.long, device=device)
    _broadcast(header)
    payload = torch.cat([input_ids.long(), torch.tensor(table, dtype=torch.long, device=device).flatten(), *blocks,
                         torch.tensor(ops, dtype=torch.long, device=device)])
    _broadcast(payload)


def broadcast_decode(graphs, input_ids: list[int], positions: list[int], slots: list[int], width: int, deltas,
                     mirror: SnapshotMirror | None = None) -> None:
    """Rank 0: the workers run this graph decode step next (DecodeGraphs.step), after the prefix cache's ops."""
    device = graphs.device
    ops = mirror.flush() if mirror is not None else []
    table = [v for slot, reset, first, ids in deltas for v in (slot, int(reset), first, len(ids))]
    ids = [b for *_, blocks in deltas for b in blocks]
    header = [DECODE, len(input_ids), len(deltas), len(ids), *_pool_key(graphs.kv, graphs.states), len(ops)]
    _broadcast(torch.tensor(header, dtype=torch.long, device=device))
    payload = [*input_ids, *positions, *slots, width, graphs.max_batch, graphs.max_width, graphs.scratch_slot,
               graphs.scratch_block, *table, *ids, *ops]
    _broadcast(torch.tensor(payload, dtype=torch.long, device=device))


def _decode_on_worker(graphs_of: dict, key: tuple, model, kv: KVPool, states: StatePool, values: list[int],
                      n: int, n_delta: int, n_ids: int, keeper=None) -> None:
    """A worker's half of broadcast_decode: its own DecodeGraphs over its twin pools, the same step."""
    from flashnext.engine.cuda_graph import DecodeGraphs

    input_ids, positions, slots = values[:n], values[n: 2 * n], values[2 * n: 3 * n]
    width, max_batch, max_width, scratch_slot, scratch_block = values[3 * n: 3 * n + _DECODE_FIXED]
    at = 3 * n + _DECODE_FIXED
    table, ids = values[at: at + _DELTA * n_delta], values[at + _DELTA * n_delta: at + _DELTA * n_delta + n_ids]
    deltas, offset = [], 0
    for i in range(n_delta):
        slot, reset, first, count = table[_DELTA * i: _DELTA * (i + 1)]
        deltas.append((slot, bool(reset), first, ids[offset: offset + count]))
        offset += count
    if key not in graphs_of:
        graphs_of[key] = DecodeGraphs(model, kv, states, max_batch, max_width, scratch=(scratch_slot, scratch_block))
        graphs_of[key].keeper = keeper
    graphs_of[key].step(input_ids, positions, slots, width, deltas)


def attach_decode_announcer(graphs, mirror: SnapshotMirror | None = None) -> None:
    """Rank 0: every graph decode step of `graphs` is announced to the workers first (broadcast_decode)."""
    graphs.announce = lambda g, *step: broadcast_decode(g, *step, mirror=mirror)


def attach_broadcaster(model: torch.nn.Module, mirror: SnapshotMirror | None = None):
    """Rank 0: every forward of `model` is announced to the workers first (with `mirror`'s snapshot ops, when
    the engine has a prefix cache). Returns the hook handle."""
    return model.register_forward_pre_hook(lambda module, args: broadcast_step(*args, mirror=mirror))


@torch.inference_mode()
def worker_loop(model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                cache: WorkerCache | None = None, keeper=None) -> int:
    """Ranks > 0: run what rank 0 announces until it says stop; returns the number of forwards run. `cache` holds
    this rank's stores of the prefix cache's lower tiers, when rank 0's cache has any; `keeper` this rank's expert
    pools' keeper (DecodeGraphs.keeper), when it has an expert cache."""
    pools: dict[tuple, tuple[KVPool, StatePool]] = {}
    graphs_of: dict[tuple, object] = {}      # pool key → this rank's DecodeGraphs over that pool
    cache = cache or WorkerCache()
    steps = 0
    while True:
        cmd, n_tok, n_seg, n_blk, pool_id, num_blocks, block_size, num_slots, n_ops = _broadcast(
            torch.empty(_HEADER, dtype=torch.long, device=device)).tolist()
        if cmd == STOP:
            cache.flush()
            for graphs in graphs_of.values():   # before the caller leaves the NCCL group (DecodeGraphs.release)
                graphs.release()
            return steps
        size = (3 * n_tok + _DECODE_FIXED + _DELTA * n_seg if cmd == DECODE else n_tok + _SEGMENT * n_seg) + n_blk + n_ops
        payload = _broadcast(torch.empty(size, dtype=torch.long, device=device))
        # a decode step's payload is all small ints: one copy to the host for everything in it
        values = payload.tolist() if cmd == DECODE else None
        ops = (values[size - n_ops:] if values is not None else payload[size - n_ops:].tolist()) if n_ops else []
        key = (pool_id, num_blocks, block_size, num_slots)
        if key not in pools:
            # Each pool of rank 0 (the engine's, or a Session's) has its twin here, sized as rank 0 planned it.
            if len(pools) >= _POOLS_KEPT:
                graphs_of.pop(next(iter(pools)), None)
                pools.pop(next(iter(pools)))
            pools[key] = (KVPool(model.cfg, num_blocks, block_size, dtype, device),
                          StatePool(model.cfg, num_slots, dtype, device))
        kv, states = pools[key]
        if cmd == OPS:
            ok = torch.tensor([int(cache.apply(ops, kv, states))], dtype=torch.long, device=device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            continue
        if cmd == DECODE:
            cache.apply(ops, kv, states)
            _decode_on_worker(graphs_of, key, model, kv, states, values, n_tok, n_seg, n_blk, keeper)
            steps += 1
            continue
        ids = payload[:n_tok]
        table = payload[n_tok: n_tok + _SEGMENT * n_seg].view(n_seg, _SEGMENT).tolist()
        blocks = payload[n_tok + _SEGMENT * n_seg: n_tok + _SEGMENT * n_seg + n_blk]
        # The prefix cache's ops since the last step, before this step's forward (and its slot resets).
        cache.apply(ops, kv, states)
        segments, offset = [], 0
        for slot, start, length, context_len, count in table:
            if context_len == 0:
                # Rank 0 resets a slot when it hands it out; here a sequence starting from token 0 is that moment.
                states.reset(slot)
            segments.append(Segment(slot, blocks[offset: offset + count], start, length, context_len))
            offset += count
        model(ids, ForwardContext(segments, kv, states))
        steps += 1
