"""Triton W4A16 matmul: y [M, N] = x [M, K] @ W.T with W held in the INT4 kernel layout (docs/int4.md).

Two kernels; `w4a16_matmul` sends M <= GEMV_MAX_M rows (decode) to the first, M >= DEQUANT_MIN_M through a
dequantised scratch weight to cuBLAS (ops/int4_dequant_triton.py; FLASHNEXT_W4A16_PREFILL=triton keeps the GEMM
kernel instead), the M between to the second.

`_w4a16_gemv_kernel` (decode, M <= 8): the weight is read once for all M rows and the read is all that costs
(Flash-Next in_proj_qkv: 13 MB, ~3 µs at 4.27 TB/s), so the kernel is shaped for bytes in flight:
- a program owns BLOCK_N output columns (contiguous int32 words: 16-byte loads along N) and a K split, so
  that N/BLOCK_N × splits is ~PROGRAMS_PER_SM programs per SM; weight loads are software-pipelined (tl.range),
  and the first K tile is loaded before the kernel waits for x (programmatic dependent launch, ops/pdl.py);
- dequantisation without int → float conversions (I2F is quarter rate or slower, and ALU throughput is
  within 2× of the bandwidth at M = 1): a nibble masked in place and ORed into the mantissa of 2**23 is
  exactly 2**23 + q·16**j as an fp32; subtracting 2**23 + zero·16**j leaves (q − zero)·16**j exactly, and
  the activation is multiplied by 16**−j instead (a power of two: exact). The upper four nibbles of a word
  go through one shift by 16 first. Per weight: and-or, sub, then one fma per row;
- the FMA mode keeps [M, BLOCK_K/8, BLOCK_N] fp32 terms (scaled per K tile: BLOCK_K divides the group
  size) and reduces over K once per program; the dot mode (`GemvConfig.use_dot`, M padded to 16) feeds
  (q − zero) in x's dtype (exact: integers times a power of two) to eight tl.dot of K = BLOCK_K/8 per tile;
- split-K without atomics on values: each program stores its fp32 partial [M, BLOCK_N], counts itself in on
  a per-column-block counter, and the last to arrive adds the partials in split order (deterministic),
  writes y in x's dtype and resets the counter. One launch, no memset: the counters live in one buffer per
  device that the kernel leaves zeroed, so two of these kernels must not run concurrently on one device
  (the engine decodes on one stream). No host sync, static shapes: CUDA-graph safe.

`_w4a16_kernel` (GEMM): `tl.dot` of x with the (q − z) tile in x's dtype — exact, those are integers in
[−16, 15] — (or, LaunchConfig.scale_in_tile, with the scaled tile, accumulating in the dot) accumulated in fp32
over a grid of (N blocks, K splits, M blocks), split-K partials added as the GEMV's are, by the last program of a
tile to arrive, in split order (deterministic: the same bits run to run; with fp32 atomics, H200 runs of one fp32
prefill differed; a buffer per split summed by torch afterwards cost two launches a call). A LaunchConfig with
block_m < 16 selects its older decode mode (fp32 multiply-and-sum, no dot), kept as the baseline
scripts/gpu_w4a16.py times the GEMV kernel against.
Both kernels multiply each K tile's fp32 partial by its group's scale and gather x's columns through `perm`
for act-order weights, so the result differs from dequantise-then-matmul only by fp32 summation order.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.ops.arrival import arrival_counters, arrive_last
from flashnext.ops.int4_dequant_triton import dequantize_triton
from flashnext.ops.int4_groups import group_zero_scale, optional_tensors
from flashnext.ops.device import num_sms
from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.weights.int4_layout import Int4Weight


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, counter_ptr,
                  M, N, K, stride_xm, stride_om, k_per_split, n_split,
                  GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
                  USE_DOT: tl.constexpr, REDUCE: tl.constexpr, REDUCE_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  SCALE_IN_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_packed = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        packed = tl.load(qw_ptr + (k0 // 8 + offs_packed)[:, None] * N + offs_n[None, :],
                         mask=mask_n[None, :], other=0)                          # [BK/8, BN] int32
        # Arithmetic shift of the top nibble sign-extends; the mask drops it.
        codes = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        group = k0 // GROUP
        if HAS_ZEROS:
            zero = tl.load(z_ptr + group * N + offs_n, mask=mask_n, other=0).to(tl.int32)
        else:
            zero = tl.full((BLOCK_N,), 8, tl.int32)
        q = codes - zero[None, :]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if HAS_PERM:
            cols = tl.load(perm_ptr + offs_k)
        else:
            cols = offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask_m[:, None], other=0.0)
        scale = tl.load(s_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if SCALE_IN_TILE:
            # the scaled tile (rounded to x's dtype) accumulated straight into acc: chained MMAs on Hopper
            acc = tl.dot(x, (q.to(tl.float32) * scale[None, :]).to(x.dtype), acc, input_precision=DOT_PRECISION)
        else:
            if USE_DOT:
                part = tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION)
            else:
                part = tl.sum(x.to(tl.float32)[:, :, None] * q.to(tl.float32)[None, :, :], axis=1)
            acc += part * scale[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if REDUCE:   # a counter per (M block, N block)
        _sum_splits(acc, part_ptr, counter_ptr + pid_m * tl.num_programs(0) + pid_n, out_ptrs, offs_m, offs_n, mask,
                    pid_k, n_split, M, N, REDUCE_ROWS, BLOCK_M, BLOCK_N)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits(y, part_ptr, counter_ptr, out_ptrs, offs_m, offs_n, mask, pid_k, n_split, M, N,
                REDUCE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K in one launch (ops/arrival.py): this split's fp32 partial y into part [n_split, M, N]; the tile's last
    program to arrive adds the partials in split order and stores the result in the output's dtype."""
    tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], y, mask=mask)
    if arrive_last(counter_ptr, n_split):
        # REDUCE_ROWS partials per load, so that their L2 latency is paid once per chunk, not per split
        y = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for first in range(0, n_split, REDUCE_ROWS):
            splits = first + tl.arange(0, REDUCE_ROWS)
            ptrs = part_ptr + (splits[:, None, None] * M + offs_m[None, :, None]) * N + offs_n[None, None, :]
            ok = (splits < n_split)[:, None, None] & mask[None, :, :]
            y += tl.sum(tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _nibble(word, j: tl.constexpr):
    """Nibble j (0..3) of each int32 word as the fp32 2**23 + q * 16**j (exact; no conversion instruction)."""
    return ((word & (0xF << (4 * j))) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _activation(x_ptr, perm_ptr, offs_m, m_ok, stride_xm, k, HAS_PERM: tl.constexpr):
    """x [BLOCK_M, len(k)] at packed rows k, in x's dtype: act-order weights gather the columns through perm."""
    if HAS_PERM:
        k = tl.load(perm_ptr + k)
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)


@triton.jit
def _gemv_tile(acc, low, zero, scale, words, x_ptr, perm_ptr, offs_m, m_ok, stride_xm,
               HAS_PERM: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + x[:, 8 * words ...] @ the K tile of packed words `low` [BLOCK_K/8, BLOCK_N]; zero and scale are
    [1, BLOCK_N] (a tile inside one group) or [BLOCK_K/8, BLOCK_N] (each word row's group: FMA mode only)."""
    high = low >> 16  # the sign bits this drags in are masked off by _nibble
    rows = 8 * words
    if USE_DOT:
        tile = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    else:
        tile = tl.zeros((BLOCK_M, BLOCK_K // 8, BLOCK_N), tl.float32)
    for j in tl.static_range(4):
        bias = 8388608.0 + zero * (1 << (4 * j))
        step = 1.0 / (1 << (4 * j))
        x_low = _activation(x_ptr, perm_ptr, offs_m, m_ok, stride_xm, rows + j, HAS_PERM)
        x_high = _activation(x_ptr, perm_ptr, offs_m, m_ok, stride_xm, rows + 4 + j, HAS_PERM)
        if USE_DOT:
            # (nibble - bias) * step is q - zero exactly; as one fma (both terms are exact) it is one op
            w_low = (_nibble(low, j) * step - bias * step).to(x_low.dtype)
            w_high = (_nibble(high, j) * step - bias * step).to(x_high.dtype)
            tile = tl.dot(x_low, w_low, tile, input_precision=DOT_PRECISION)
            tile = tl.dot(x_high, w_high, tile, input_precision=DOT_PRECISION)
        else:
            tile += (x_low.to(tl.float32) * step)[:, :, None] * (_nibble(low, j) - bias)[None, :, :]
            tile += (x_high.to(tl.float32) * step)[:, :, None] * (_nibble(high, j) - bias)[None, :, :]
    if USE_DOT:
        acc += tile * scale
    else:
        acc += tile * scale[None, :, :]
    return acc


@triton.jit
def _weight_tile(qw_ptr, z_ptr, s_ptr, k0, group_size, N, offs_n, n_ok, HAS_ZEROS: tl.constexpr,
                 ROW_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K tile at k0: (its packed rows, their words [BLOCK_K/8, BLOCK_N], zero, scale), zero and scale of its one
    group as [1, BLOCK_N], or of each word row's group as [BLOCK_K/8, BLOCK_N] (ROW_GROUPS)."""
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    low = tl.load(qw_ptr + words[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0)
    if ROW_GROUPS:
        groups = (8 * words // group_size)[:, None]
    else:
        groups = k0 // group_size
    zero, scale = group_zero_scale(z_ptr, s_ptr, groups, N, offs_n[None, :], n_ok[None, :], HAS_ZEROS, BLOCK_N)
    return words, low, zero, scale


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, counter_ptr,
                       M, N, K, stride_xm, stride_om, group_size, k_per_split, n_split,
                       HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, USE_DOT: tl.constexpr,
                       REDUCE: tl.constexpr, REDUCE_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       NUM_STAGES: tl.constexpr, PDL: tl.constexpr, ROW_GROUPS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K // 8, BLOCK_N), tl.float32)
    # The first K tile (every program has one) is loaded before the wait: with PDL it is in flight while the
    # previous kernel finishes (ops/pdl.py).
    k_start = pid_k * k_per_split
    words, low, zero, scale = _weight_tile(qw_ptr, z_ptr, s_ptr, k_start, group_size, N, offs_n, n_ok,
                                           HAS_ZEROS, ROW_GROUPS, BLOCK_N, BLOCK_K)
    wait_for_inputs(PDL)
    acc = _gemv_tile(acc, low, zero, scale, words, x_ptr, perm_ptr, offs_m, m_ok, stride_xm,
                     HAS_PERM, USE_DOT, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    for k0 in tl.range(k_start + BLOCK_K, tl.minimum(k_start + k_per_split, K), BLOCK_K, num_stages=NUM_STAGES):
        words, low, zero, scale = _weight_tile(qw_ptr, z_ptr, s_ptr, k0, group_size, N, offs_n, n_ok,
                                               HAS_ZEROS, ROW_GROUPS, BLOCK_N, BLOCK_K)
        acc = _gemv_tile(acc, low, zero, scale, words, x_ptr, perm_ptr, offs_m, m_ok, stride_xm,
                         HAS_PERM, USE_DOT, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if USE_DOT:
        y = acc
    else:
        y = tl.sum(acc, axis=1)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if REDUCE:
        _sum_splits(y, part_ptr, counter_ptr + pid_n, out_ptrs, offs_m, offs_n, mask, pid_k, n_split, M, N,
                    REDUCE_ROWS, BLOCK_M, BLOCK_N)
    else:
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LaunchConfig:
    """Tiles of the GEMM kernel (block_m < 16: its fp32 multiply-and-sum mode, no dot)."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    scale_in_tile: bool = False   # with use_dot: the tile scaled before the dot (see _w4a16_kernel)

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16


@dataclass(frozen=True)
class GemvConfig:
    """Launch of the GEMV kernel. block_k divides the group size (and is >= 128 with use_dot: each of the
    eight dots of a tile has K = block_k / 8 >= 16); split_k is the number of K splits asked for (the grid
    gets ceil(K tiles / ceil(K tiles / split_k)) of them, each with >= 1 tile)."""
    block_n: int
    block_k: int
    split_k: int
    use_dot: bool = False
    num_warps: int = 4
    num_stages: int = 3


GEMV_MAX_M = 8        # w4a16_matmul sends M <= GEMV_MAX_M to the GEMV kernel
# M >= DEQUANT_MIN_M dequantises the weight and multiplies with cuBLAS (ops/int4_dequant_triton.py) unless
# FLASHNEXT_W4A16_PREFILL=triton. H200, Flash-Next's four dense shapes (scripts/gpu_prefill_gemm.py, 2026-11-30):
# 2.3–2.8× faster than the GEMM kernel at 512, 1,808 and 8,192 rows (10240 × 2560: 59 vs 134, 150 vs 404,
# 613 vs 1,575 µs; its best swept tile 1,138), the dequantisation 15–27 µs a weight. Below 512 not measured.
DEQUANT_MIN_M = 256
PROGRAMS_PER_SM = 4   # GEMV grid target: enough programs for bytes in flight on every SM
# Configs measured on the H200 (scripts/gpu_w4a16.py prints this table's entries): (N, K, M bucket) →
# GemvConfig. Shapes not listed take gemv_config's heuristic. Flash-Next and Qwen3-Next shapes at M = 8, sweep of
# 2026-11-29 (bf16, g128, symmetric; the L2-cold graph time): 10–40% faster than the heuristic. The M = 1 entries
# of that sweep were for the unstacked shapes the step no longer runs, and the kernel has changed since.
TUNED: dict[tuple[int, int, int], GemvConfig] = {
    # M = 1, the stacked projections of the Flash-Next decode step (models/stacked.py) and its out/down
    # projections, sweep of 2026-11-30 (commit 7411c88, L2-cold): 21.3 / 17.8 / 4.0 / 10.5 / 3.1 µs
    (16384, 2560, 1): GemvConfig(32, 128, 1, False, 4, 3),
    (13312, 2560, 1): GemvConfig(64, 128, 6, False, 4, 3),
    (1280, 2560, 1): GemvConfig(32, 512, 5, False, 4, 1),
    (2560, 6144, 1): GemvConfig(32, 128, 14, False, 4, 3),
    (2560, 640, 1): GemvConfig(32, 128, 5, False, 4, 1),
    (10240, 2560, 8): GemvConfig(256, 128, 7, True, 4, 3),
    (6144, 2560, 8): GemvConfig(256, 128, 11, True, 4, 2),
    (2560, 6144, 8): GemvConfig(64, 128, 14, True, 4, 3),
    (12288, 2560, 8): GemvConfig(256, 128, 5, True, 4, 3),
    (512, 2560, 8): GemvConfig(32, 128, 16, True, 4, 4),
    (640, 2560, 8): GemvConfig(32, 128, 13, True, 4, 4),
    (2560, 640, 8): GemvConfig(256, 128, 5, True, 4, 4),
    (12288, 2048, 8): GemvConfig(256, 128, 5, True, 4, 2),
    (2048, 4096, 8): GemvConfig(64, 128, 8, True, 4, 3),
    (512, 2048, 8): GemvConfig(32, 128, 16, True, 4, 2),
    (2048, 512, 8): GemvConfig(64, 128, 4, True, 4, 3),
}


def m_bucket(m: int) -> int:
    """The GEMV kernel's BLOCK_M for m rows (1, 2, 4, 8): configs are chosen per bucket."""
    return triton.next_power_of_2(m)


_GEMV_CONFIGS: dict[tuple, GemvConfig] = {}


def gemv_fits(cfg: GemvConfig, k: int, group_size: int) -> bool:
    """Whether the GEMV kernel can run `cfg`: K tiles inside one group (a divisor of it), or of whole groups
    that divide K (FMA mode only), of >= 16 rows (>= 128 with use_dot: eight dots of K = block_k / 8)."""
    return cfg.block_k >= (128 if cfg.use_dot else 16) and (group_size % cfg.block_k == 0 or (
        cfg.block_k % group_size == 0 and k % cfg.block_k == 0 and not cfg.use_dot))


def gemv_config(m: int, n: int, k: int, group_size: int, device: torch.device) -> GemvConfig:
    """The GEMV launch for this shape: TUNED if listed, else a heuristic, cached per (N, K, g, M bucket, SMs).

    Heuristic: 128-column blocks (64, 32 when N x K is too small to give every SM its programs), K tiles of
    128 rows (64 for the 8-row FMA mode: its [M, K/8, N] fp32 terms live in registers), K split until there
    are PROGRAMS_PER_SM programs per SM (half that above 2 rows); tensor cores (M padded to 16) from 5 rows
    on, where one fma per row and weight would outrun the CUDA cores' share of the bandwidth. A guess until
    the sweep of scripts/gpu_w4a16.py fills TUNED. (Tiles of a program's whole K share, several groups each,
    lost to it on every stacked Flash-Next shape at M = 1, 2 and 4 on the H200: 37 µs against 21 for qkv|z.)"""
    bucket = m_bucket(m)
    key = (n, k, group_size, bucket, num_sms(device))
    cfg = _GEMV_CONFIGS.get(key)
    if cfg is not None:
        return cfg
    cfg = TUNED.get((n, k, bucket))
    if cfg is None or not gemv_fits(cfg, k, group_size):
        use_dot = bucket > 4 and group_size >= 128
        block_k = min(group_size, 64 if bucket > 4 and not use_dot else 128)
        tiles = k // block_k
        # above 2 rows a program has more arithmetic per byte and the partials grow with M: half the programs
        target = PROGRAMS_PER_SM * num_sms(device) // (1 if bucket <= 2 else 2)
        block_n = 128
        while block_n > 32 and triton.cdiv(n, block_n) * tiles < target:
            block_n //= 2
        split = max(1, min(tiles, triton.cdiv(target, triton.cdiv(n, block_n))))
        cfg = GemvConfig(block_n, block_k, split, use_dot, num_warps=4 if bucket <= 2 else 8)
    _GEMV_CONFIGS[key] = cfg
    return cfg


def default_config(m: int, n: int, k: int, group_size: int, device: torch.device) -> LaunchConfig:
    """GEMM-kernel tiles by problem size (m <= 4: its no-dot mode); split K until the grid has about two
    programs per SM."""
    if m <= 4:
        block_m = triton.next_power_of_2(m)
        block_n, block_k, warps, stages = 64, min(group_size, 128 // block_m), 4, 4
    elif m <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, min(group_size, 128), 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 64, 128, min(group_size, 64), 4, 3
    else:
        # H200 sweep at M = 8192 (scripts/gpu_prefill_gemm.py): K tiles of 128 beat 64 by ~13% on every shape
        block_m, block_n, block_k, warps, stages = 128, 128, min(group_size, 128), 8, 3
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = max(1, min(triton.cdiv(2 * num_sms(device), programs), k // block_k))
    return LaunchConfig(block_m, block_n, block_k, split, warps, stages)


def supports(w: Int4Weight) -> bool:
    """The kernels need K tiles of >= 16 rows that never straddle a group, and contiguous tensors (they take N as
    the row stride; a stacked projection's parts are column views: models/stacked.py)."""
    return (w.group_size >= 16 and w.group_size & (w.group_size - 1) == 0 and w.qweight.dim() == 2
            and all(t.is_contiguous() for t in w.tensors().values()))


def reduce_rows(block_m: int, block_n: int, num_warps: int) -> int:
    """Partials the last program of a split-K tile loads at once (_sum_splits): ~32 fp32 registers a thread (not a
    function of the split, which would compile a kernel per split count)."""
    return min(32, max(1, 32 * 32 * num_warps // (block_m * block_n)))


def _split_buffers(x: torch.Tensor, m: int, n: int, split: int, tiles: int):
    """The output [m, n], and for a split K the fp32 partials [split, m, n] and arrival counters for `tiles` tiles
    (_sum_splits; the output stands in for both, never read, without a split)."""
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if split == 1:
        return out, out, out
    return out, torch.empty(split, m, n, dtype=torch.float32, device=x.device), arrival_counters(x.device, tiles)


def _gemv(x: torch.Tensor, w: Int4Weight, cfg: GemvConfig) -> torch.Tensor:
    m, k = x.shape
    n = w.out_features
    # a tile inside one group, or (FMA mode) whole groups that divide K
    row_groups = cfg.block_k > w.group_size
    assert m <= GEMV_MAX_M and gemv_fits(cfg, k, w.group_size), (m, k, w.group_size, cfg)
    tiles = k // cfg.block_k
    per = triton.cdiv(tiles, max(1, min(cfg.split_k, tiles)))
    split = triton.cdiv(tiles, per)
    blocks = triton.cdiv(n, cfg.block_n)
    out, part, counters = _split_buffers(x, m, n, split, blocks)
    zeros, perm = optional_tensors(w)
    block_m = 16 if cfg.use_dot else m_bucket(m)
    _w4a16_gemv_kernel[(blocks, split)](
        x, w.qweight, w.scales, zeros, perm, out, part, counters,
        m, n, k, x.stride(0), out.stride(0), w.group_size, per * cfg.block_k, split,
        HAS_ZEROS=w.zeros is not None, HAS_PERM=w.perm is not None, USE_DOT=cfg.use_dot,
        REDUCE=split > 1, REDUCE_ROWS=reduce_rows(block_m, cfg.block_n, cfg.num_warps),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None, NUM_STAGES=cfg.num_stages,
        ROW_GROUPS=row_groups, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device))
    return out


def w4a16_matmul(x: torch.Tensor, w: Int4Weight, config: LaunchConfig | GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (row-major) → [M, N] in x's dtype. M <= GEMV_MAX_M: the GEMV kernel, else the GEMM kernel;
    a config forces its kernel (GemvConfig only for M <= GEMV_MAX_M)."""
    m, k = x.shape
    n = w.out_features
    assert k == w.in_features and supports(w), (tuple(x.shape), tuple(w.qweight.shape), w.group_size)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m == 0:
        return x.new_empty(0, n)
    if config is None and m >= DEQUANT_MIN_M and os.environ.get("FLASHNEXT_W4A16_PREFILL", "dequant") == "dequant":
        return x @ dequantize_triton(w, x.dtype)
    if config is None:
        config = gemv_config(m, n, k, w.group_size, x.device) if m <= GEMV_MAX_M else \
            default_config(m, n, k, w.group_size, x.device)
    if isinstance(config, GemvConfig):
        return _gemv(x, w, config)
    cfg = config
    assert w.group_size % cfg.block_k == 0, "a K tile must not straddle two groups"
    steps = k // cfg.block_k
    k_per_split = triton.cdiv(steps, cfg.split_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    out, part, counters = _split_buffers(x, m, n, split, grid[0] * grid[2])
    zeros, perm = optional_tensors(w)
    _w4a16_kernel[grid](
        x, w.qweight, w.scales, zeros, perm, out, part, counters,
        m, n, k, x.stride(0), out.stride(0), k_per_split, split,
        GROUP=w.group_size, HAS_ZEROS=w.zeros is not None, HAS_PERM=w.perm is not None,
        USE_DOT=cfg.use_dot, REDUCE=split > 1, REDUCE_ROWS=reduce_rows(cfg.block_m, cfg.block_n, cfg.num_warps),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        SCALE_IN_TILE=cfg.scale_in_tile and cfg.use_dot, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
