"""QSA token lists in one kernel (reference and contract: ops/qsa_token_lists.py).

A program a row. The row's scores become int32 keys whose signed order is the floats' order; the k-th largest key T
is found by bisecting [min, max] (32 halvings, each one count over the row: the count of keys ≥ the midpoint);
then one pass in block order selects every key > T and the first k − count(> T) keys equal to T, and writes each
selected block's tokens at its rank among the selected (a cumulative sum): the lists come out in ascending block
order with no sort. Rows of up to CHUNK scores stay in registers through the bisection; longer rows (contexts
beyond 64K on Flash-Next) are read again, CHUNK at a time, by every count.
"""
from __future__ import annotations

import triton
import triton.language as tl

import torch

from flashnext.ops.pdl import launch_options, wait_for_inputs

CHUNK = 16384   # scores a program holds in registers (Flash-Next: 64K tokens of context)


@triton.jit
def _chunk_keys(row_ptr, c, n, CHUNK: tl.constexpr):
    """Chunk c of the row as (keys, in range): fp32 bits mapped so that signed int32 order is float order."""
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < n
    s = tl.load(row_ptr + offs, mask=ok, other=float("-inf")) + 0.0      # + 0.0: −0.0 becomes 0.0
    bits = s.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF), ok


@triton.jit
def _count(row_ptr, n, keys0, ok0, t, STRICT: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    """How many keys of the row are ≥ t (> t if STRICT); keys0/ok0: chunk 0, already loaded."""
    hit = (keys0 > t) if STRICT else (keys0 >= t)
    total = tl.sum((hit & ok0).to(tl.int32), axis=0)
    for c in range(1, NUM_CHUNKS):
        keys, ok = _chunk_keys(row_ptr, c, n, CHUNK)
        hit = (keys > t) if STRICT else (keys >= t)
        total += tl.sum((hit & ok).to(tl.int32), axis=0)
    return total


@triton.jit
def _qsa_token_lists_kernel(scores_ptr, pos_ptr, index_ptr, valid_ptr, n, stride_s, K, limit, width,
                            R: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    row_ptr = scores_ptr + row.to(tl.int64) * stride_s
    keys0, ok0 = _chunk_keys(row_ptr, 0, n, CHUNK)
    # Lanes past n hold −inf's key, below or equal to every score's: min and max need no mask, and count(≥ min)
    # over the row is n ≥ K, so T, the largest t with count(keys ≥ t) ≥ K, lies in [min, max].
    lo = tl.min(keys0, axis=0)
    hi = tl.max(keys0, axis=0)
    for c in range(1, NUM_CHUNKS):
        keys, _ = _chunk_keys(row_ptr, c, n, CHUNK)
        lo = tl.minimum(lo, tl.min(keys, axis=0))
        hi = tl.maximum(hi, tl.max(keys, axis=0))
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    for _ in range(32):   # each halves [lo, hi] (2^32 keys at most); once lo = hi, mid = lo and nothing moves
        mid = lo + (hi - lo + 1) // 2
        enough = _count(row_ptr, n, keys0, ok0, mid.to(tl.int32), False, CHUNK, NUM_CHUNKS) >= K
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    threshold = lo.to(tl.int32)
    ties_wanted = K - _count(row_ptr, n, keys0, ok0, threshold, True, CHUNK, NUM_CHUNKS)

    pos = tl.load(pos_ptr + row).to(tl.int64)
    complete_before = (pos + 1) // R
    out_index = index_ptr + row.to(tl.int64) * width
    out_valid = valid_ptr + row.to(tl.int64) * width
    ties_before = 0
    chosen_before = 0
    for c in tl.static_range(NUM_CHUNKS):
        if NUM_CHUNKS == 1:
            keys, ok = keys0, ok0
        else:
            keys, ok = _chunk_keys(row_ptr, c, n, CHUNK)
        tie = ((keys == threshold) & ok).to(tl.int32)
        tie_rank = ties_before + tl.cumsum(tie, axis=0) - tie
        chosen = (((keys > threshold) & ok) | ((tie == 1) & (tie_rank < ties_wanted))).to(tl.int32)
        rank = chosen_before + tl.cumsum(chosen, axis=0) - chosen
        block = (c * CHUNK + tl.arange(0, CHUNK)).to(tl.int64)
        block_valid = (block < complete_before).to(tl.uint8)
        for j in tl.static_range(R):
            tl.store(out_index + rank * R + j, block * R + j, mask=chosen == 1)
            tl.store(out_valid + rank * R + j, block_valid, mask=chosen == 1)
        ties_before += tl.sum(tie, axis=0)
        chosen_before += tl.sum(chosen, axis=0)
    for j in tl.static_range(R - 1):   # the tail of the query's incomplete block
        tail = complete_before * R + j
        tl.store(out_index + K * R + j, tl.minimum(tail, limit - 1))
        tl.store(out_valid + K * R + j, (tail <= pos).to(tl.uint8))


def qsa_token_lists_triton(scores: torch.Tensor, pos: torch.Tensor, k: int, ratio: int,
                           limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = scores.shape
    assert scores.dtype == torch.float32 and scores.stride(-1) == 1 and pos.shape == (rows,)
    width = k * ratio + ratio - 1
    token_index = torch.empty(rows, width, dtype=torch.int64, device=scores.device)
    token_valid = torch.empty(rows, width, dtype=torch.bool, device=scores.device)
    if rows:
        chunk = min(CHUNK, triton.next_power_of_2(n))
        _qsa_token_lists_kernel[(rows,)](
            scores, pos, token_index, token_valid.view(torch.uint8), n, scores.stride(0), k, limit, width,
            R=ratio, CHUNK=chunk, NUM_CHUNKS=triton.cdiv(n, chunk), num_warps=16 if chunk >= 4096 else 4,
            **launch_options(scores.device))
    return token_index, token_valid
