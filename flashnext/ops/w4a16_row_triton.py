"""Triton W4A16 GEMV for one row: y [1, N] = x [1, K] @ W.T, W in the INT4 kernel layout (docs/int4.md).

The decode step's widest dense INT4 projections at batch 1 (`faster`: N ≥ ROW_MIN_N; ops/w4a16.py dispatches). A
GEMV reads each weight once and does one multiply-add with it, so at 4 bits a weight it is as much a race of
instructions as of bytes: Flash-Next's stacked qkv|z (21 MB, ~5 µs at 4.27 TB/s) takes tinygemm 13 µs on L2-warm
weights (8.4 M warp instructions, ncu), and ops/w4a16_triton.py's GEMV spends ~11 SASS instructions a weight (a thread
held one column of a few words: each activation it loaded and converted served one weight). Here ~4:
- a program owns BLOCK_N columns (2–4 a thread: 8–16-byte loads along N) and `groups` whole quantisation groups of
  K, the first loaded before it waits for x (ops/pdl.py), the rest in a pipelined loop;
- each thread holds all of its columns' words of a group, so an activation it loads (one address across the warp:
  a broadcast) serves all its columns, and the sum over the group's K stays in the thread;
- a weight costs three instructions: its nibble, masked in place, ORed under the exponent of 2**(23 − 4j) (one LOP3:
  the fp32 2**(23 − 4j) + q, exact, the nibble's position giving the mantissa's unit), minus 2**(23 − 4j) + zero
  (exact), one FMA with x;
- groups apart are summed by the arrival counters (ops/arrival.py): each program stores its fp32 partial, the last
  of a column block adds them in split order (deterministic) and writes y.
The result differs from w4a16_linear_reference only by fp32 summation order (tinygemm's bf16 products: ~5e-3).
Symmetric and asymmetric weights; no act-order permutation (those keep w4a16_triton). H200, L2-cold µs a call
(scripts/gpu_w4a16_row.py, session 22): qkv|z 16384 × 2560 12.9 against tinygemm's 14.5, q|k|v 13312 × 2560 11.3
against 12.6, Qwen3-Next's qkv|z 12288 × 2048 8.4 against 9.7; narrower shapes lose (out_proj 2560 × 6144 7.9 against
7.6, the shared expert's 4.7–5.6 against 2.8–4.2: too few columns for the grid), so they keep tinygemm. A
tensor-core form (the nibbles as bf16 (q − zero) pairs through one LOP3 and a bf16x2 FMA, then eight dots a group)
took 18.6 µs for qkv|z: Triton moved each plane to the dot's layout through shared memory, ~5.4 instructions a
weight. ncu on the H200 (Triton 3.6): 255 registers a thread at 512 columns and 4 warps, 11% occupancy, 0.43 warp
instructions issued a cycle — latency, not the instruction count, is what is left.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.ops.arrival import arrival_counters, arrive_last
from flashnext.ops.device import num_sms
from flashnext.ops.pdl import launch_options, wait_for_inputs
from flashnext.weights.int4_layout import Int4Weight


def interpreting() -> bool:
    """Under TRITON_INTERPRET=1 (the CPU tests) there is no inline PTX."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _magic_nibble(word, j: tl.constexpr, ASM: tl.constexpr):
    """Nibble j (0..3) of each int32 word as the fp32 2**(23 − 4j) + q, exactly: the nibble, masked in place (bits
    4j..4j+3), is the mantissa field q·2**4j of a float whose exponent makes the mantissa's unit 2**−4j, so no shift,
    no conversion and no rescaling of x are needed. ASM: one LOP3 ((word & mask) | exponent; the compiler emits an
    and and an or), else in Triton (the interpreter)."""
    if ASM:   # the exponent field of 2**(23 − 4j): (127 + 23 − 4j) << 23
        bits = tl.inline_asm_elementwise(f"lop3.b32 $0, $1, {0xF << (4 * j)}, {(150 - 4 * j) << 23}, 0xEA;", "=r,r",
                                         [word], dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (word & (0xF << (4 * j))) | ((150 - 4 * j) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_sum(part_ptr, out_ptr, offs_n, n_ok, N, n_split, REDUCE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The last program of a column block: the splits' fp32 partials [n_split, N] added in split order → y."""
    # REDUCE_ROWS partials a load, so that their L2 latency is paid once a chunk, not once a split
    total = tl.zeros((BLOCK_N,), tl.float32)
    for first in range(0, n_split, REDUCE_ROWS):
        splits = first + tl.arange(0, REDUCE_ROWS)
        parts = tl.load(part_ptr + splits[:, None] * N + offs_n[None, :],
                        mask=(splits < n_split)[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg")
        total += tl.sum(parts, axis=0)
    tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _group_tile(qw_ptr, s_ptr, z_ptr, group, N, offs_n, n_ok, HAS_ZEROS: tl.constexpr, GROUP_WORDS: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Group `group` of K for columns offs_n → (its word rows [W, BN] int32, zero [BN], scale [BN], both fp32)."""
    words = group * GROUP_WORDS + tl.arange(0, GROUP_WORDS)
    q = tl.load(qw_ptr + words[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0)
    scale = tl.load(s_ptr + group * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + group * N + offs_n, mask=n_ok, other=0).to(tl.float32)
    else:
        zero = tl.full((BLOCK_N,), 8.0, tl.float32)
    return q, zero, scale


@triton.jit
def _group_product(q, zero, scale, x_ptr, group, GROUP_WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
                   ASM: tl.constexpr):
    """x's share of one group · its weights → [BN] fp32: Σ over the words w and nibbles j of x[8w + j]·(q − zero),
    times the group's scale. Each thread holds its columns' words of the group, so an activation it loads serves all
    of its columns and the sum over the words stays in the thread."""
    words = group * GROUP_WORDS + tl.arange(0, GROUP_WORDS)
    part = tl.zeros((GROUP_WORDS, BLOCK_N), tl.float32)
    for half in tl.static_range(2):   # nibbles 0–3, then 4–7 (q >> 16: the sign bits it drags in are masked off)
        bits = q >> (16 * half)
        for j in tl.static_range(4):
            bias = ((1 << (23 - 4 * j)) + zero)[None, :]   # nibble − bias = q − zero, exactly (Sterbenz)
            xj = tl.load(x_ptr + 8 * words + 4 * half + j).to(tl.float32)
            part += xj[:, None] * (_magic_nibble(bits, j, ASM) - bias)
    return tl.sum(part, axis=0) * scale


@triton.jit
def _w4a16_row_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, counter_ptr, N, n_groups, groups_per_split,
                      HAS_ZEROS: tl.constexpr, GROUP_WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
                      NUM_STAGES: tl.constexpr, REDUCE_ROWS: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    first = pid_k * groups_per_split
    # the first group is loaded before the wait (in flight while the previous kernel ends), the rest pipelined:
    # their loads run ahead of the arithmetic on the groups before them
    q, zero, scale = _group_tile(qw_ptr, s_ptr, z_ptr, first, N, offs_n, n_ok, HAS_ZEROS, GROUP_WORDS, BLOCK_N)
    wait_for_inputs(PDL)
    y = _group_product(q, zero, scale, x_ptr, first, GROUP_WORDS, BLOCK_N, ASM)
    for group in tl.range(first + 1, tl.minimum(first + groups_per_split, n_groups), num_stages=NUM_STAGES):
        q, zero, scale = _group_tile(qw_ptr, s_ptr, z_ptr, group, N, offs_n, n_ok, HAS_ZEROS, GROUP_WORDS, BLOCK_N)
        y += _group_product(q, zero, scale, x_ptr, group, GROUP_WORDS, BLOCK_N, ASM)
    n_split = tl.num_programs(1)
    if n_split == 1:
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(part_ptr + pid_k * N + offs_n, y, mask=n_ok)
        if arrive_last(counter_ptr + pid_n, n_split):
            _store_sum(part_ptr, out_ptr, offs_n, n_ok, N, n_split, REDUCE_ROWS, BLOCK_N)


@dataclass(frozen=True)
class RowConfig:
    block_n: int = 512    # columns a program (4 a thread at 4 warps)
    groups: int = 1       # quantisation groups of K a program (a pipelined loop past the first)
    num_warps: int = 4
    num_stages: int = 2


ROW_MIN_N = 8192   # `faster`: narrower projections keep tinygemm (see the module's docstring)
# (N, K) → RowConfig, H200 sweep of session 22 (scripts/gpu_w4a16_row.py, L2-cold); others take row_config's rule
TUNED = {(16384, 2560): RowConfig(512, 1, 4), (13312, 2560): RowConfig(512, 2, 4)}


def faster(w: Int4Weight) -> bool:
    """Whether this kernel beats tinygemm for the weight at one row (measured: from ROW_MIN_N columns;
    FLASHNEXT_W4A16_ROW_MIN_N overrides it, e.g. 0 to run a tiny model's projections through it)."""
    return w.out_features >= int(os.environ.get("FLASHNEXT_W4A16_ROW_MIN_N", ROW_MIN_N))


def row_config(n: int, k: int, group_size: int, device: torch.device) -> RowConfig:
    """TUNED, else columns a program halved from 512 (not below 128) until the grid has ~4 programs an SM."""
    if (n, k) in TUNED:
        return TUNED[(n, k)]
    n_groups = k // group_size
    block_n = 512
    while block_n > 128 and triton.cdiv(n, block_n) * n_groups < 4 * num_sms(device):
        block_n //= 2
    return RowConfig(block_n, 1, max(1, min(4, block_n // 128)))


def supports(x: torch.Tensor, w: Int4Weight) -> bool:
    """One row, no act-order permutation, groups of 32–128 columns (16 words at most a group in registers), N a
    multiple of 4 (16-byte loads), contiguous tensors."""
    return (x.dim() == 2 and x.shape[0] == 1 and w.perm is None and w.qweight.dim() == 2
            and w.group_size in (32, 64, 128) and w.out_features % 4 == 0
            and all(t.is_contiguous() for t in w.tensors().values()))


def w4a16_row(x: torch.Tensor, w: Int4Weight, config: RowConfig | None = None) -> torch.Tensor:
    """x [1, K] → [1, N] in x's dtype (see the module's docstring; supports() must hold)."""
    k, n = w.in_features, w.out_features
    assert supports(x, w) and x.shape[1] == k, (tuple(x.shape), tuple(w.qweight.shape), w.group_size)
    x = x if x.stride(-1) == 1 else x.contiguous()
    cfg = config or row_config(n, k, w.group_size, x.device)
    n_groups = k // w.group_size
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(n_groups, cfg.groups))
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if grid[1] == 1:
        part, counters = out, out
    else:
        part = torch.empty(grid[1], n, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, grid[0])
    _w4a16_row_kernel[grid](
        x, w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, out, part, counters, n, n_groups,
        cfg.groups, HAS_ZEROS=w.zeros is not None, GROUP_WORDS=w.group_size // 8, BLOCK_N=cfg.block_n,
        NUM_STAGES=cfg.num_stages, REDUCE_ROWS=max(1, 32 * 32 * cfg.num_warps // cfg.block_n),
        ASM=not interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device))
    return out
