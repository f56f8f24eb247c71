"""QSA token lists in Triton (reference and contract: ops/qsa_token_lists.py).

The selection works on int32 keys whose signed order is the scores' order (NaN, which relu sums never give, would
sort by its bits, not first as in the reference's torch.sort). A row of up to CHUNK keys sits in one
program's registers: its k-th largest key T is found by bisecting [min, max] — a step counts the keys ≥ three
quarter points at once (one int64 sum of three packed counts), so 16 steps instead of 32 reductions —, then one
cumulative sum ranks the keys > T and the first k − count(> T) keys equal to T, and each chosen block's tokens are
written at its rank: the lists come out in ascending block order with no sort.

Rows longer than CHUNK (more than 64K tokens of context on Flash-Next) take two launches: programs over slices of
the row first keep each slice's top k (as keys and block indices, in block order), then the list kernel selects
from those candidates. Exact: a block among the row's top k is among its slice's top k (fewer than k of its slice
rank before it), and the candidates stay in block order, so ties still go to the lower block.
"""
from __future__ import annotations

import triton
import triton.language as tl

import torch

from flashnext.ops.pdl import launch_options, wait_for_inputs

CHUNK = 16384     # keys a program holds (Flash-Next: 64K tokens of context); counts ≤ CHUNK pack in 21 bits
assert CHUNK < 1 << 21


@triton.jit
def _score_keys(scores_ptr, offs, ok):
    """fp32 scores → int32 keys in the same order (−0.0 as 0.0); lanes not ok get INT32_MIN, which no score maps
    to (only a NaN would), so they never count above a threshold past the row's minimum."""
    s = tl.load(scores_ptr + offs, mask=ok, other=0.0) + 0.0
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(ok, bits ^ ((bits >> 31) & 0x7FFFFFFF), -2147483648)


@triton.jit
def _threshold(keys, K):
    """(T, ties): T is the largest t with count(keys ≥ t) ≥ K, ties how many keys equal to T the top K take.

    16 steps, each a reduction over the row (~54 µs for 16,384 keys on the H200, the reductions' latency, it seems).
    Radix selection (four 256-bin histograms) was slower there at every size (78 µs at 16,384 keys, 102 at 65,536 in
    two stages, against 54 and 87), so it was removed."""
    lo = tl.min(keys, axis=0).to(tl.int64)
    hi = tl.max(keys, axis=0).to(tl.int64)
    for _ in range(16):   # [lo, hi] shrinks to a quarter each step: 2^32 keys in 16; once lo = hi nothing moves
        d = hi - lo
        m1 = lo + (d + 3) // 4
        m2 = lo + (2 * d + 3) // 4
        m3 = lo + (3 * d + 3) // 4
        # m1 ≤ m2 ≤ m3 lie in [lo, hi], within int32
        packed = ((keys >= m1.to(tl.int32)).to(tl.int64) + ((keys >= m2.to(tl.int32)).to(tl.int64) << 21)
                  + ((keys >= m3.to(tl.int32)).to(tl.int64) << 42))
        total = tl.sum(packed, axis=0)
        c1 = total & 0x1FFFFF
        c2 = (total >> 21) & 0x1FFFFF
        c3 = total >> 42
        new_lo = tl.where(c3 >= K, m3, tl.where(c2 >= K, m2, tl.where(c1 >= K, m1, lo)))
        hi = tl.where(c3 >= K, hi, tl.where(c2 >= K, m3 - 1, tl.where(c1 >= K, m2 - 1, m1 - 1)))
        lo = new_lo
    threshold = lo.to(tl.int32)
    return threshold, K - tl.sum((keys > threshold).to(tl.int32), axis=0)


@triton.jit
def _top(keys, K):
    """(chosen, rank): the top K keys — those > T and the first keys equal to T, T the K-th largest — each with its
    rank among the chosen (their order)."""
    threshold, ties = _threshold(keys, K)
    tie = (keys == threshold).to(tl.int32)
    chosen = ((keys > threshold) | ((tie == 1) & (tl.cumsum(tie, axis=0) - tie < ties))).to(tl.int32)
    return chosen == 1, tl.cumsum(chosen, axis=0) - chosen


@triton.jit(do_not_specialize=["n"])
def _slice_top_kernel(scores_ptr, cand_key_ptr, cand_block_ptr, n, stride_s, K, SLICE: tl.constexpr,
                      PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    block = part * SLICE + tl.arange(0, SLICE)
    keys = _score_keys(scores_ptr + row.to(tl.int64) * stride_s, block, block < n)
    chosen, rank = _top(keys, K)
    out = (row.to(tl.int64) * tl.num_programs(1) + part) * K + rank
    tl.store(cand_key_ptr + out, keys, mask=chosen)
    tl.store(cand_block_ptr + out, block, mask=chosen)


@triton.jit(do_not_specialize=["n", "limit"])
def _lists_kernel(scores_ptr, cand_block_ptr, pos_ptr, index_ptr, valid_ptr, n, stride_s, K, limit, width,
                  R: tl.constexpr, CHUNK: tl.constexpr, CANDIDATES: tl.constexpr, PDL: tl.constexpr):
    """scores_ptr: the row's scores, or with CANDIDATES the slices' candidate keys (n of them a row, block indices at
    cand_block_ptr, both rows stride_s apart)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    ok = offs < n
    if CANDIDATES:
        keys = tl.load(scores_ptr + row.to(tl.int64) * stride_s + offs, mask=ok, other=-2147483648)
        block = tl.load(cand_block_ptr + row.to(tl.int64) * stride_s + offs, mask=ok, other=0).to(tl.int64)
    else:
        keys = _score_keys(scores_ptr + row.to(tl.int64) * stride_s, offs, ok)
        block = offs.to(tl.int64)
    chosen, rank = _top(keys, K)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    complete_before = (pos + 1) // R
    out_index = index_ptr + row.to(tl.int64) * width
    out_valid = valid_ptr + row.to(tl.int64) * width
    block_valid = (block < complete_before).to(tl.uint8)
    for j in tl.static_range(R):
        tl.store(out_index + rank * R + j, block * R + j, mask=chosen)
        tl.store(out_valid + rank * R + j, block_valid, mask=chosen)
    for j in tl.static_range(R - 1):   # the tail of the query's incomplete block
        tail = complete_before * R + j
        tl.store(out_index + K * R + j, tl.minimum(tail, limit - 1))
        tl.store(out_valid + K * R + j, (tail <= pos).to(tl.uint8))


# Rows from which a launch is a prefill's block of queries (QUERY_BLOCK of ops/prefill_attention: 1,024) rather than
# a decode or chained step's few (at most 128); 32 warps were measured at 1,024 rows only.
MANY_ROWS = 256


def _warps(size: int, rows: int = 1) -> int:
    """Warps a program: on the H200 (scripts/gpu_qsa_lists.py) 8 were best for single rows at 2,500, 16,384 and
    65,536 blocks (14.9, 54.8, 86.5 µs a call; 16 warps 17.6, 71.0, 90.3) and for 1,024 rows at 7,500 blocks (234.7
    µs; 16 warps 232.8); 1,024 rows of 10,000 and 16,384 blocks (a single-stage list, CHUNK keys a program) took
    678 / 692 µs at 32 warps against 779 / 815 at 8 (session 21)."""
    if size == CHUNK and rows >= MANY_ROWS:
        return 32
    return 8 if size >= 2048 else 4


def fits(n: int, k: int) -> bool:
    """Whether the kernels select k of n scores: in one program, or in two stages whose candidates (slices × k, the
    slices at most CHUNK long) fit one program (~524K blocks at k = 512; past that the dispatcher takes the
    reference)."""
    return 0 < k <= n and (n <= CHUNK or (CHUNK // k) * CHUNK >= n)


def qsa_token_lists_triton(scores: torch.Tensor, pos: torch.Tensor, k: int, ratio: int,
                           limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = scores.shape
    assert scores.dtype == torch.float32 and scores.stride(-1) == 1 and pos.shape == (rows,) and pos.is_contiguous()
    assert fits(n, k), f"{n} blocks, top {k}: more than two stages can select"
    width = k * ratio + ratio - 1
    token_index = torch.empty(rows, width, dtype=torch.int64, device=scores.device)
    token_valid = torch.empty(rows, width, dtype=torch.bool, device=scores.device)
    if not rows:
        return token_index, token_valid
    pdl = launch_options(scores.device)
    source, blocks, count, stride = scores, scores, n, scores.stride(0)
    if n > CHUNK:
        slices = CHUNK // k                       # candidates (slices × k) must fit one program
        size = max(triton.next_power_of_2(triton.cdiv(n, slices)), triton.next_power_of_2(k))
        slices = triton.cdiv(n, size)
        source = torch.empty(rows, slices * k, dtype=torch.int32, device=scores.device)
        blocks = torch.empty(rows, slices * k, dtype=torch.int32, device=scores.device)
        _slice_top_kernel[(rows, slices)](scores, source, blocks, n, scores.stride(0), k, SLICE=size,
                                          num_warps=_warps(size), **pdl)
        count, stride = slices * k, slices * k
    chunk = triton.next_power_of_2(count)
    _lists_kernel[(rows,)](source, blocks, pos, token_index, token_valid.view(torch.uint8), count, stride, k, limit,
                           width, R=ratio, CHUNK=chunk, CANDIDATES=n > CHUNK,
                           num_warps=_warps(chunk, 1 if n > CHUNK else rows), **pdl)
    return token_index, token_valid
