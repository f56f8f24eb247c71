"""What the prefix cache tiers hold and exchange: KV block contents and state snapshots, named by hashes.

A block is named by a chained hash of every token up to its end, so equal names mean equal prefixes; a
snapshot by the name of its last full block plus the tail tokens after it. Names are stable across
processes (blake2b, not Python's `hash`), so the disk tier finds its entries again after a restart.
"""
from __future__ import annotations

import bisect
import hashlib
from array import array
from dataclasses import dataclass

import torch

from flashnext.weights.pinned import to_device

ROOT_HASH = bytes(16)


def block_hash(parent: bytes, tokens) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def snapshot_key(last_block: bytes, tail) -> bytes:
    return hashlib.blake2b(b"snapshot" + last_block + array("q", tail).tobytes(), digest_size=16).digest()


def chain_hashes(tokens, block_size: int, num_blocks: int) -> list[bytes]:
    """[root, hash of block 1, …, hash of block num_blocks]: index d names the prefix of d blocks."""
    out = [ROOT_HASH]
    for i in range(num_blocks):
        out.append(block_hash(out[-1], tokens[i * block_size:(i + 1) * block_size]))
    return out


_GROUPS = ("k", "v", "index_keys")
# Blocks per batch moved between the device and a lower tier, both ways (TierIndex.put gathers them down, write_blocks
# copies them back up): bounds the device staging memory (256 Flash-Next blocks of 16 tokens are ~100 MB) while a
# 58K-token conversation takes ~15 copies per tensor.
WRITE_PIECE = 256


def _pool_tensors(kv):
    for group in _GROUPS:
        for layer, t in getattr(kv, group).items():
            yield f"{group}.{layer}", t


def read_block(kv, block: int) -> dict[str, torch.Tensor]:
    """Views of one KV block in every attention layer (K, V and the indexer's pooled keys)."""
    return {name: t[block] for name, t in _pool_tensors(kv)}


def write_block(kv, block: int, data: dict[str, torch.Tensor]) -> None:
    for name, t in _pool_tensors(kv):
        t[block].copy_(data[name], non_blocking=True)


def read_blocks(kv, blocks: list[int]) -> dict[str, torch.Tensor]:
    """Several KV blocks as one batch: name → [len(blocks), …], one gather per tensor of the pool (a lower
    tier then takes a conversation in one copy per tensor, not one per block and tensor: 130,500 copies for
    a 58K-token Flash-Next conversation)."""
    index = to_device(blocks, kv.device)   # no host wait: write-behind gathers between steps queued ahead
    return {name: t.index_select(0, index) for name, t in _pool_tensors(kv)}


def run_rows(run: dict[str, torch.Tensor]) -> int:
    """Blocks in one run (a batch: name → [rows, …])."""
    return len(next(iter(run.values())))


def row_segments(runs: list[dict[str, torch.Tensor]], rows: list[int]) -> list[tuple[int, int, int]]:
    """Rows `rows` of the blocks that `runs` (batches whose rows, in order, are the blocks) hold, as (run, first
    row in it, rows) of each stretch of consecutive rows inside one run: a resumed entry's rows are one range
    across its runs, so a few stretches, not a tensor a row (~3,600 rows for a 58K-token Flash-Next entry)."""
    starts, at = [], 0
    for run in runs:
        starts.append(at)
        at += run_rows(run)
    segments: list[tuple[int, int, int]] = []
    i, j, count = 0, 0, 0      # the stretch under way
    for row in rows:
        if count and row == starts[i] + j + count and (i + 1 == len(starts) or row < starts[i + 1]):
            count += 1
            continue
        if count:
            segments.append((i, j, count))
        i = bisect.bisect_right(starts, row) - 1
        j, count = row - starts[i], 1
    if count:
        segments.append((i, j, count))
    return segments


def batch_rows(runs: list[dict[str, torch.Tensor]], rows: list[int]) -> dict[str, torch.Tensor]:
    """Rows `rows` of `runs` (see row_segments) as one batch: a view when they are consecutive rows of one run,
    else a copy."""
    segments = row_segments(runs, rows)
    if len(segments) == 1:
        i, j, count = segments[0]
        return {name: t[j: j + count] for name, t in runs[i].items()}
    return {name: torch.cat([runs[i][name][j: j + count] for i, j, count in segments]) for name in runs[0]}


def write_blocks(kv, blocks: list[int], runs: list[dict[str, torch.Tensor]], rows: list[int]) -> None:
    """Rows `rows` of `runs` (see row_segments) into device blocks `blocks`, from the runs' own rows (page-locked in
    the host tier: asynchronous copies), never joined on the host first (that was a host memcpy into pageable memory,
    then a synchronous copy, for pieces across runs). A stretch of DIRECT_MIN_BLOCKS or more consecutive rows of one
    run bound for consecutive blocks is one copy per tensor of the pool, straight into its blocks; the other rows go
    per stretch of consecutive rows, at most WRITE_PIECE at a time, as one copy to the device and one scatter per
    tensor. On the H200 a 58K-token Flash-Next entry (~3,600 blocks, 36 pool tensors) took 25–46 ms of host time to
    install as scatters only (~1,100 copies and scatters queued, session 23), against ~26 ms for its bytes over PCIe;
    that the queued calls are what took it is inferred, and the straight copies are not yet timed there."""
    direct, rest = _direct_stretches(runs, blocks, rows)
    for i, j, block, count in direct:
        for name, t in _pool_tensors(kv):
            t[block: block + count].copy_(runs[i][name][j: j + count], non_blocking=True)
    if not rest:
        return
    rest_blocks, rest_rows = zip(*rest)
    # the block ids sent once, without a host wait (torch.tensor(..., device=) would wait for the stream each time)
    targets = to_device(list(rest_blocks), kv.device)
    at = 0
    for i, j, count in row_segments(runs, list(rest_rows)):
        for first in range(j, j + count, WRITE_PIECE):
            n = min(WRITE_PIECE, j + count - first)
            index = targets[at: at + n]
            for name, t in _pool_tensors(kv):
                t.index_copy_(0, index, runs[i][name][first: first + n].to(kv.device, non_blocking=True))
            at += n


DIRECT_MIN_BLOCKS = 8


def _direct_stretches(runs, blocks: list[int], rows: list[int]):
    """→ ((run, first row in it, first block, count) of each stretch of at least DIRECT_MIN_BLOCKS consecutive rows of
    one run bound for consecutive blocks, [(block, row) of every other row, in order])."""
    direct, rest, at = [], [], 0
    for i, j, count in row_segments(runs, rows):
        start = 0
        for k in range(1, count + 1):
            if k < count and blocks[at + k] == blocks[at + k - 1] + 1:
                continue
            if k - start >= DIRECT_MIN_BLOCKS:
                direct.append((i, j + start, blocks[at + start], k - start))
            else:
                rest.extend((blocks[at + m], rows[at + m]) for m in range(start, k))
            start = k
        at += count
    return direct, rest


def tensor_bytes(tensors: dict[str, torch.Tensor] | None) -> int:
    return sum(t.numel() * t.element_size() for t in (tensors or {}).values())


PIN_ALIGN = 64   # bytes: where each tensor starts inside a host buffer shared by several


def _offsets(tensors: dict[str, torch.Tensor]) -> list[int]:
    """Where each tensor starts in a shared host buffer, and (last) the buffer's size."""
    starts = [0]
    for t in tensors.values():
        starts.append(starts[-1] + -(-t.numel() * t.element_size() // PIN_ALIGN) * PIN_ALIGN)
    return starts


def packed_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """The size of the one host buffer copy_tensors puts these tensors in."""
    return _offsets(tensors)[-1]


def copy_tensors(tensors: dict[str, torch.Tensor], device, pin: bool = False,
                 into: torch.Tensor | None = None, wait: bool = True) -> dict[str, torch.Tensor]:
    """Copies on `device`; `pin`: host copies in pinned memory, written once (not copied to pageable first).
    `wait` False: host copies from a device are only queued on the current stream (host_copies.py waits for them).

    Host copies share one buffer (views at PIN_ALIGN offsets; `into`, a uint8 tensor of packed_bytes, when given,
    e.g. from the host tier's PinnedArena) and wait for their device once: page-locking memory costs ~1.3 ms a
    call on the H200's host, and a snapshot of full-size Flash-Next is 86 state tensors (one allocation and one
    synchronous copy each cost a 32K-token agent turn ~200 ms before the first token)."""
    if torch.device(device).type != "cpu":
        # asynchronous from page-locked memory (a host-tier entry's buffers), as write_blocks copies its blocks: the
        # host goes on to schedule the resumed request while the copies run, and a buffer given back to the
        # tier's arena is handed out again only after an event recorded behind them (pinned_arena.py); 86 state
        # tensors of a Flash-Next snapshot had each waited for the stream, the entry's ~1.6 GB of blocks first
        out = {}
        for name, t in tensors.items():
            out[name] = torch.empty(t.shape, dtype=t.dtype, device=device)
            out[name].copy_(t, non_blocking=True)
        return out
    starts = _offsets(tensors)
    flat = into if into is not None else torch.empty(starts[-1], dtype=torch.uint8, pin_memory=pin)
    out = {}
    for (name, t), start in zip(tensors.items(), starts):
        out[name] = flat[start: start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out[name].copy_(t, non_blocking=True)
    if wait:
        for t in tensors.values():
            if t.is_cuda:   # the copies ran on t's device's current stream: the host may read them after this
                torch.cuda.current_stream(t.device).synchronize()
                break
    return out


@dataclass
class Snapshot:
    """The recurrent state of a sequence after `num_tokens` tokens, plus the KV of its partial last block.

    Only full KV blocks are shared between sequences (a sequence writes into its last block). When the
    snapshot position is not block-aligned, the partial block's contents travel with the snapshot
    (`tail_kv`, one block) and are copied into a fresh block of the sequence that resumes from it.
    """
    num_tokens: int
    tail: tuple[int, ...]                       # tokens after the last full block
    state: dict[str, torch.Tensor]              # StatePool.snapshot of the slot
    tail_kv: dict[str, torch.Tensor] | None     # read_block of the partial block; None when aligned

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.state) + tensor_bytes(self.tail_kv)

    def to(self, device, pin: bool = False) -> Snapshot:
        tail_kv = copy_tensors(self.tail_kv, device, pin) if self.tail_kv is not None else None
        return Snapshot(self.num_tokens, self.tail, copy_tensors(self.state, device, pin), tail_kv)
