"""Triton paged decode attention (flash-decoding, split-K); shapes and semantics in ops/decode_attention.py.

Two kernels:
- `_split_kernel`, grid (B, KVH, num_splits): one program takes all H / KVH query heads of one kv head (so
  each K/V byte is read once, not once per query head) over one range of positions (dense) or of
  token_index entries (sparse). It loads K/V tiles through the block table, runs an online softmax in fp32
  and writes an unnormalised partial (acc [G, D], running max m, sum of exponentials l) in fp32.
  The query heads are padded to 16 rows so both products are `tl.dot`s (tensor cores); P is rounded to V's
  dtype for P·V, as flash attention does.
- `_merge_kernel`, grid (B, H): rescales the partials to a common max and divides once.

The number of splits is static (from B, KVH and the table's span W·BS or T), so the launch can be captured in
a CUDA graph; each sequence spreads its *real* length over the splits on the device (at least MIN_SPLIT
positions each), so a short sequence in a graph captured for 64K still uses several programs. Splits past a
sequence's length write nothing and the merge reads only the splits that the length reaches.
Scores live in the log2 domain (scale · log2 e folded in, exp2). The running max starts at −1e30, not −inf,
so a tile with no visible position gives exp2(−inf) = 0 instead of NaN; a sequence that sees nothing
gets l = 0 and an output of zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.ops.device import num_sms
from flashnext.ops.pdl import launch_options, wait_for_inputs

LOG2E = 1.4426950408889634


@triton.jit
def _split_span(n, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Positions per split for a sequence of n: n spread evenly, in whole tiles, at least MIN_SPLIT."""
    per = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per, MIN_SPLIT)


# num_splits and T vary with batch and table shapes: not specialising on them keeps compiles per model few.
@triton.jit(do_not_specialize=["num_splits", "T"])
def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, index_ptr, valid_ptr,
                  acc_ptr, m_ptr, l_ptr,
                  num_splits, qk_scale, T,
                  stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  stride_table, stride_index, stride_valid,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                  SPARSE: tl.constexpr, HAS_VALID: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MIN_SPLIT: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(lens_ptr + b)
    if SPARSE:
        n = T
    else:
        n = seq_len
    per = _split_span(n, num_splits, BLOCK_N, MIN_SPLIT)
    lo = split * per
    if lo < n:
        hi = tl.minimum(lo + per, n)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < GROUP
        mask_d = offs_d < HEAD_DIM
        head = kvh * GROUP + offs_h
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            slot = start + tl.arange(0, BLOCK_N)
            live = slot < hi
            if SPARSE:
                pos = tl.load(index_ptr + b * stride_index + slot, mask=live, other=0)
                if HAS_VALID:
                    live = live & (tl.load(valid_ptr + b * stride_valid + slot, mask=live, other=0) != 0)
                live = live & (pos < seq_len)
            else:
                pos = slot
            page = tl.load(table_ptr + b * stride_table + pos // PAGE, mask=live, other=0).to(tl.int64)
            in_page = pos % PAGE
            k = tl.load(k_ptr + (page * stride_kb + in_page * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :],
                        mask=live[:, None] & mask_d[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + (page * stride_vb + in_page * stride_vt + kvh * stride_vh)[:, None] + offs_d[None, :],
                        mask=live[:, None] & mask_d[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        row = (b * num_heads + head) * num_splits + split                        # partials are [B, H, S(, D)]
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_h[:, None] & mask_d[None, :])
        tl.store(m_ptr + row, m_i, mask=mask_h)
        tl.store(l_ptr + row, l_i, mask=mask_h)


@triton.jit(do_not_specialize=["num_splits", "T"])
def _merge_kernel(acc_ptr, m_ptr, l_ptr, lens_ptr, out_ptr, num_splits, T,
                  SPARSE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    if SPARSE:
        n = T
    else:
        n = tl.load(lens_ptr + b)
    active = tl.cdiv(n, _split_span(n, num_splits, BLOCK_N, MIN_SPLIT))
    base = (b * tl.num_programs(1) + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    live = offs_s < active
    m = tl.load(m_ptr + base + offs_s, mask=live, other=float("-inf"))
    m_max = tl.maximum(tl.max(m, 0), -1e30)
    l = tl.sum(tl.exp2(m - m_max) * tl.load(l_ptr + base + offs_s, mask=live, other=0.0), 0)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(active):
        weight = tl.exp2(tl.load(m_ptr + base + s) - m_max)
        acc += weight * tl.load(acc_ptr + (base + s) * HEAD_DIM + offs_d, mask=mask_d, other=0.0)
    out = acc / tl.where(l > 0, l, 1.0)                                           # l = 0: nothing seen, acc = 0
    tl.store(out_ptr + (b * tl.num_programs(1) + h) * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


# The merge's split lanes (BLOCK_S) at least this many: only its two 1-D loads of the splits' maxima and sums are that
# wide, and the split count varies with the rows (an eager prefill's token-list attention takes one split past ~130
# rows, a few for a short chunk): one variant for them all instead of one per power of two, each compiled on the way
# of the first request to meet it (H200, session 17: a 5,007-token prompt past 16K of context compiled one).
MERGE_MIN_SPLITS = 32


@dataclass(frozen=True)
class LaunchConfig:
    num_splits: int
    block_n: int = 32
    min_split: int = 128          # positions; a multiple of block_n
    num_warps: int = 4
    num_stages: int = 3


# Token lists of many rows (a prefill chunk's queries past 16K of context, one split each): 64-token tiles, 2 warps
# and no pipelining (H200, scripts/gpu_decode_attention.py --prefill-rows: 4,096 queries × 2,051 tokens after 32K
# 3.22 ms a call against 3.69 with the decode tiles below; 1,024 queries 0.82 against 1.00).
LIST_ROWS = LaunchConfig(1, block_n=64, min_split=256, num_warps=2, num_stages=1)


def default_config(batch: int, kv_heads: int, head_dim: int, span: int, device: torch.device,
                   sparse: bool = False) -> LaunchConfig:
    """Splits from static sizes only (CUDA graphs): about two programs per SM at the longest length the
    table can hold, never fewer than min_split positions per split at that length; token lists (`sparse`) of
    rows enough for one split each take LIST_ROWS' tiles."""
    block_n = 32 if head_dim > 128 else 64
    min_split = 4 * block_n
    want = triton.cdiv(2 * num_sms(device), max(1, batch * kv_heads))
    if sparse and want == 1 and head_dim > 128:
        return LIST_ROWS
    return LaunchConfig(max(1, min(want, triton.cdiv(span, min_split))), block_n, min_split)


def split_k_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                             token_index: torch.Tensor | None = None, token_valid: torch.Tensor | None = None,
                             config: LaunchConfig | None = None) -> torch.Tensor:
    """See ops/decode_attention.py for shapes. No host sync; temporaries sized from B, H, D and num_splits."""
    batch, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    assert heads % kv_heads == 0 and v_cache.shape == k_cache.shape, (tuple(q.shape), tuple(k_cache.shape))
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_table.stride(-1) == 1 and seq_lens.dim() == 1 and seq_lens.stride(0) == 1
    sparse = token_index is not None
    span = token_index.shape[1] if sparse else block_table.shape[1] * page
    cfg = config or default_config(batch, kv_heads, head_dim, span, q.device, sparse)
    assert cfg.min_split % cfg.block_n == 0
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0 or span == 0:
        return out.zero_()
    splits = cfg.num_splits
    part_acc = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_m = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    index = token_index if sparse else seq_lens
    valid = token_valid.view(torch.uint8) if token_valid is not None else seq_lens
    assert index.stride(-1) == 1 and valid.stride(-1) == 1
    group = heads // kv_heads
    block_d = triton.next_power_of_2(head_dim)
    pdl = launch_options(q.device)
    _split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_table, seq_lens, index, valid, part_acc, part_m, part_l,
        splits, scale * LOG2E, span if sparse else 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), index.stride(0), valid.stride(0),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, SPARSE=sparse, HAS_VALID=token_valid is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        MIN_SPLIT=cfg.min_split, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    _merge_kernel[(batch, heads)](
        part_acc, part_m, part_l, seq_lens, out, splits, span if sparse else 0,
        SPARSE=sparse, HEAD_DIM=head_dim, BLOCK_N=cfg.block_n, MIN_SPLIT=cfg.min_split,
        BLOCK_S=max(MERGE_MIN_SPLITS, triton.next_power_of_2(splits)), BLOCK_D=block_d,
        num_warps=4 if block_d >= 256 else 1,
        **pdl)
    return out


def compile_list_rows(heads: int, kv_heads: int, head_dim: int, page: int, width: int, dtype: torch.dtype,
                      device: torch.device) -> None:
    """Compile the LIST_ROWS variant before a request meets it (the engine's warm-up prompts stay below the context
    where a prompt's token lists start), with the arguments' types and layouts of IndexedAttention's call: one
    sequence's table expanded over the rows, int64 positions and lengths, lists `width` wide with validity."""
    rows = triton.cdiv(2 * num_sms(device), kv_heads)
    q = torch.zeros(rows, heads, head_dim, dtype=dtype, device=device)
    cache = torch.zeros(1, page, kv_heads, head_dim, dtype=dtype, device=device)
    index = torch.zeros(rows, width, dtype=torch.long, device=device)
    valid = torch.ones(rows, width, dtype=torch.bool, device=device)
    lens = torch.ones(rows, dtype=torch.long, device=device)
    table = torch.zeros(1, 1, dtype=torch.long, device=device).expand(rows, -1)
    split_k_decode_attention(q, cache, cache, table, lens, 1.0, token_index=index, token_valid=valid)
