"""Prefill-sized routed experts with INT4 weights, dequantised in registers as the MMA's left operand (reference:
ops/moe_int4.py; the other prefill paths: ops/moe_int4_triton.py, ops/moe_int4_dequant.py).

Hopper's MMA (wgmma) reads its left operand from registers and its right one from shared memory. The grouped kernels
of moe_int4_triton dequantise a weight tile in registers and give it to the MMA as the right operand, so every tile
goes to shared memory and back; here the product is transposed (out^T = W^T x^T: a tile is [BLOCK_N, BLOCK_M], the
rows — tokens — the MMA's narrow side), so the weights are the left operand. They must also reach it without a
layout shuffle, which a nibble unpacking that interleaves rows (word i holds rows 8i..8i+7) needs: so the K loop
takes each packed tile of TILE_K rows as eight sub-tiles, nibble j of every word being rows 8i+j, i < TILE_K/8 —
plain shifts of the loaded words — and the activations' columns come in the matching order: `swizzle_columns`
permutes them once per call (within each TILE_K block, column 8i+j moves to j·TILE_K/8 + i), and the gate|up kernel
writes h in that order for the down kernel. A sum over K in another order: the same products, added in another
order (sub-tiles 0, 4, 1, 5, 2, 6, 3, 7 of each packed tile: nibbles j and j + 4 of a word are dequantised together,
by ops/int4_magic.py's trick for 16-bit activations on a GPU).

    1. gate_up: h[row] = silu(x[token] @ gate_e) * (x[token] @ up_e), rounded to x's dtype, rows in expert order.
    2. down: rows[row] = h[row] @ down_e, rounded to x's dtype, in expert order.
    3. out[token] = sum_j weight[token, j] * rows[position of (token, j)] in fp32 (ops/moe_combine.py).

Weights are rounded to x's dtype after their scale, as the dequantised path rounds them. Not for act-order weights
(each expert permutes its own rows) nor group sizes below 128 on a GPU (a sub-tile's 16 rows are the MMA's least K).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.ops.moe_combine import combine_choices
from flashnext.ops.expert_order import expert_order
from flashnext.ops.int4_magic import magic_dequant, magic_operands, magic_pair
from flashnext.ops.moe_int4_triton import _block_rows
from flashnext.weights.int4_layout import Int4Weight

TILE_K = 128   # rows of a packed tile: eight sub-tiles of 16, the MMA's K


@dataclass(frozen=True)
class SwappedConfig:
    block_m: int = 128    # rows (tokens) a program: the MMA's N side
    block_n: int = 64     # output columns a program: the MMA's M side (64 a warp group)
    num_warps: int = 4
    num_stages: int = 3


# The tiles for an average of r rows an expert: block_m the power of two from 16 to 128 that holds r (fewer rows
# waste the MMA's N side on masked rows, more run an expert's rows as several blocks, each re-reading its weights),
# the rest the fastest measured with that block_m. H200, per layer, ms (scripts/gpu_moe.py --swapped-sizes, session
# 20, twelve configs; 512 experts, top-10, so r = tokens / 51.2):
#     tokens (r)    Flash-Next: these tiles / the fastest    Qwen3-Next: these tiles / the fastest
#     256 (5)       0.932 / same                             0.941 / 0.916 (64 × 128)
#     512 (10)      0.995 / same                             0.986 / 0.949 (64 × 128)
#     1,024 (20)    1.147 / same                             0.823 / same
#     2,048 (40)    1.460 / same                             1.035 / same
#     4,096 (80)    2.107 / same                             1.498 / same
#     8,192 (160)   3.942 / same                             2.731 / 2.713 (64 × 128)
TILES = {16: SwappedConfig(16, 128, 4, 3), 32: SwappedConfig(32, 64, 4, 4), 64: SwappedConfig(64, 128, 4, 3),
         128: SwappedConfig(128, 64, 4, 3)}


def config_for(rows_per_expert: float) -> SwappedConfig:
    """The measured tiles (TILES) for this many (token, choice) rows an expert on average."""
    return TILES[next((bm for bm in sorted(TILES) if bm >= rows_per_expert), max(TILES))]


def tile_k(group_size: int) -> int:
    """The rows a packed tile holds: TILE_K, or a smaller group (the interpreter's tiny models)."""
    return min(TILE_K, group_size)


def runs_swapped(w_gate_up: Int4Weight, w_down: Int4Weight, device: torch.device) -> bool:
    """Whether these experts suit the kernels: no act-order, groups of TILE_K rows or a multiple (any power-of-two
    group under the interpreter)."""
    if w_gate_up.perm is not None or w_down.perm is not None:
        return False
    groups = (w_gate_up.group_size, w_down.group_size)
    if device.type == "cuda":
        return all(g % TILE_K == 0 for g in groups)
    return all(g % 8 == 0 and (g & (g - 1)) == 0 for g in groups)


def swizzle_columns(x: torch.Tensor, tile: int) -> torch.Tensor:
    """x [M, K] with the columns of each block of `tile` in the kernels' order: 8i+j → j·tile/8 + i."""
    m, k = x.shape
    return x.view(m, k // tile, tile // 8, 8).transpose(-1, -2).reshape(m, k)


@triton.jit
def _nibble_tile(packed, j: tl.constexpr, zero, scale, dtype: tl.constexpr):
    """Sub-tile j of a packed tile [BLOCK_N, SUB] of words: the weights of rows 8i+j, scaled, in `dtype`. (Forming
    q − zero from the nibbles' bits as fp32, without the int→float conversion, measured 1–3% slower: session 20.)"""
    q = (packed >> (4 * j)) & 0xF
    return ((q - zero[:, None]).to(tl.float32) * scale[:, None].to(tl.float32)).to(dtype)


@triton.jit
def _nibble_pair(packed, j: tl.constexpr, zero, scale, dtype: tl.constexpr, MAGIC: tl.constexpr):
    """Sub-tiles j and j + 4 (j < 4) of a packed tile, by ops/int4_magic.py's trick with MAGIC, else one at a time:
    the same bits either way."""
    if MAGIC:
        offset_pair, scale_pair = magic_operands(zero, scale, dtype)
        return magic_pair(packed, j, offset_pair, scale_pair, dtype)
    return _nibble_tile(packed, j, zero, scale, dtype), _nibble_tile(packed, j + 4, zero, scale, dtype)


@triton.jit
def _packed_tile(qweight_ptr, scales_ptr, zeros_ptr, k0, group_size, offs_n, n_ok, N,
                 HAS_ZEROS: tl.constexpr, SUB: tl.constexpr):
    """The words of rows k0 .. k0+8·SUB of columns offs_n ([BLOCK_N, SUB]), their zero points (int32) and scales (in
    their dtype)."""
    words = k0 // 8 + tl.arange(0, SUB)
    packed = tl.load(qweight_ptr + words[None, :] * N + offs_n[:, None], mask=n_ok[:, None], other=0)
    group = k0 // group_size
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + group * N + offs_n, mask=n_ok, other=0).to(tl.int32)
    else:
        zero = tl.full(offs_n.shape, 8, tl.int32)
    scale = tl.load(scales_ptr + group * N + offs_n, mask=n_ok, other=0)
    return packed, zero, scale


@triton.jit(do_not_specialize=["n_pairs"])
def _gate_up_kernel(x_ptr, h_ptr, sorted_ids_ptr, order_ptr, block_start_ptr, qweight_ptr, scales_ptr, zeros_ptr,
                    n_pairs, H, I, group_size, TOP_K: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    MAGIC: tl.constexpr, PRECISION: tl.constexpr, SUB: tl.constexpr, DOWN_SUB: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start = tl.load(block_start_ptr + tl.program_id(0))
    if start < 0:  # a spare entry of the block table
        return
    expert, rows, ok, pair = _block_rows(start, sorted_ids_ptr, order_ptr, n_pairs, BLOCK_M)
    N = 2 * I
    qweight_ptr += expert * (H // 8) * N
    scales_ptr += expert * (H // group_size) * N
    zeros_ptr += expert * (H // group_size) * N
    token = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_s = tl.arange(0, SUB)
    gate = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(0, H, 8 * SUB):
        packed_g, zero_g, scale_g = _packed_tile(qweight_ptr, scales_ptr, zeros_ptr, k0, group_size, offs_n, n_ok, N,
                                                 HAS_ZEROS, SUB)
        packed_u, zero_u, scale_u = _packed_tile(qweight_ptr, scales_ptr, zeros_ptr, k0, group_size, I + offs_n, n_ok,
                                                 N, HAS_ZEROS, SUB)
        for j in tl.static_range(4):
            # swizzled columns: sub-tile j of this packed tile is SUB contiguous columns; j and j + 4 come together
            a_low = tl.load(x_ptr + token[None, :] * H + (k0 + j * SUB + offs_s)[:, None], mask=ok[None, :], other=0)
            a_high = tl.load(x_ptr + token[None, :] * H + (k0 + (j + 4) * SUB + offs_s)[:, None], mask=ok[None, :],
                             other=0)
            gate_low, gate_high = _nibble_pair(packed_g, j, zero_g, scale_g, a_low.dtype, MAGIC)
            up_low, up_high = _nibble_pair(packed_u, j, zero_u, scale_u, a_low.dtype, MAGIC)
            gate = tl.dot(gate_low, a_low, gate, input_precision=PRECISION)
            up = tl.dot(up_low, a_low, up, input_precision=PRECISION)
            gate = tl.dot(gate_high, a_high, gate, input_precision=PRECISION)
            up = tl.dot(up_high, a_high, up, input_precision=PRECISION)
    h = (gate * tl.sigmoid(gate) * up).to(h_ptr.dtype.element_ty)
    # h's columns in the down kernel's order: within each block of 8·DOWN_SUB, column 8i+j at j·DOWN_SUB + i
    tile = 8 * DOWN_SUB
    column = (offs_n // tile) * tile + (offs_n % 8) * DOWN_SUB + (offs_n % tile) // 8
    tl.store(h_ptr + rows[None, :] * I + column[:, None], h, mask=ok[None, :] & n_ok[:, None])


@triton.jit(do_not_specialize=["n_pairs"])
def _down_kernel(h_ptr, y_ptr, sorted_ids_ptr, order_ptr, block_start_ptr, qweight_ptr, scales_ptr, zeros_ptr,
                 n_pairs, H, I, group_size, HAS_ZEROS: tl.constexpr, MAGIC: tl.constexpr, PRECISION: tl.constexpr,
                 SUB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start = tl.load(block_start_ptr + tl.program_id(0))
    if start < 0:  # a spare entry of the block table
        return
    expert, rows, ok, pair = _block_rows(start, sorted_ids_ptr, order_ptr, n_pairs, BLOCK_M)
    qweight_ptr += expert * (I // 8) * H
    scales_ptr += expert * (I // group_size) * H
    zeros_ptr += expert * (I // group_size) * H
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_s = tl.arange(0, SUB)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(0, I, 8 * SUB):
        packed, zero, scale = _packed_tile(qweight_ptr, scales_ptr, zeros_ptr, k0, group_size, offs_n, n_ok, H,
                                           HAS_ZEROS, SUB)
        for j in tl.static_range(4):
            a_low = tl.load(h_ptr + rows[None, :] * I + (k0 + j * SUB + offs_s)[:, None], mask=ok[None, :], other=0)
            a_high = tl.load(h_ptr + rows[None, :] * I + (k0 + (j + 4) * SUB + offs_s)[:, None], mask=ok[None, :],
                             other=0)
            w_low, w_high = _nibble_pair(packed, j, zero, scale, a_low.dtype, MAGIC)
            acc = tl.dot(w_low, a_low, acc, input_precision=PRECISION)
            acc = tl.dot(w_high, a_high, acc, input_precision=PRECISION)
    tl.store(y_ptr + rows[None, :] * H + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=ok[None, :] & n_ok[:, None])


def moe_int4_swapped(x, topk_ids, topk_weights, w_gate_up: Int4Weight, w_down: Int4Weight,
                     config: SwappedConfig | None = None) -> torch.Tensor:
    """Same contract as ops.moe_int4.moe_int4_reference, for experts where `runs_swapped` holds; `config` by default
    `config_for` the rows an expert."""
    m, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, _, two_i = w_gate_up.qweight.shape
    inter = two_i // 2
    if config is None:
        config = config_for(topk_ids.numel() / num_experts)
    plan = expert_order(topk_ids, num_experts, config.block_m)
    sorted_ids, order, block_start = plan.sorted_ids, plan.order, plan.block_start
    n_pairs = order.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(n_pairs, inter, dtype=x.dtype, device=x.device)
    rows = torch.empty(n_pairs, hidden, dtype=x.dtype, device=x.device)
    magic = magic_dequant(x.dtype, x.device, w_gate_up.scales.dtype, w_down.scales.dtype)
    common = dict(PRECISION=precision, MAGIC=magic, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    tile_up, tile_down = tile_k(w_gate_up.group_size), tile_k(w_down.group_size)
    _gate_up_kernel[(block_start.numel(), triton.cdiv(inter, config.block_n))](
        swizzle_columns(x.contiguous(), tile_up), h, sorted_ids, order, block_start, w_gate_up.qweight,
        w_gate_up.scales, w_gate_up.scales if w_gate_up.zeros is None else w_gate_up.zeros,
        n_pairs, hidden, inter, w_gate_up.group_size, TOP_K=top_k, HAS_ZEROS=w_gate_up.zeros is not None,
        SUB=tile_up // 8, DOWN_SUB=tile_down // 8, **common)
    _down_kernel[(block_start.numel(), triton.cdiv(hidden, config.block_n))](
        h, rows, sorted_ids, order, block_start, w_down.qweight, w_down.scales,
        w_down.scales if w_down.zeros is None else w_down.zeros, n_pairs, hidden, inter, w_down.group_size,
        HAS_ZEROS=w_down.zeros is not None, SUB=tile_down // 8, **common)
    return combine_choices(rows, plan.position.view(m, top_k), topk_weights, x.dtype)
