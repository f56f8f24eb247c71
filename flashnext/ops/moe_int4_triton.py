"""Routed experts with INT4 weights in two Triton kernels plus a sum over k (reference: ops/moe_int4.py).

The (token, slot) pairs are sorted by expert and cut into blocks of at most BLOCK_M rows of one expert, so
every program reads one expert's weights for one N tile, and an expert chosen by several tokens is read
once per step (decode) or once per BLOCK_M rows (prefill).
  1. gate_up: h[row] = silu(x[token] @ gate_e) * (x[token] @ up_e), both halves in one pass over K; h is
     [M*k, I] in x's dtype, rows in sorted order.
  2. down: y[pair] = topk_weight[pair] * (h[row] @ down_e), fp32, rows in pair order (token*k + slot).
  3. out = y.view(M, k, H).sum(1): a second pass instead of atomics, so the result is deterministic
     (same bits run to run and batch to batch) and summed in fp32; it costs M*k*H*8 bytes of traffic,
     0.8 MB at decode M=8 against ~200 MB of expert weights.
Act-order weights (perm) gather the activation columns inside the K loop. Dequantisation stays exact: a BLOCK_K never straddles a quantisation group, so the tile multiplies the
small integers (q - zero), exact in bf16, and the group scale is applied to the fp32 partial product.

The pairs' order and the block table (each expert's run cut into blocks of BLOCK_M rows: a grouped GEMM, tl.dot
tensor cores, dequant in the K loop) come from ops/expert_order.py, without a host sync (CUDA-graph safe); with
M·k <= BLOCK_M every expert that has rows gets one block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.ops.expert_order import expert_order
from flashnext.weights.int4_layout import Int4Weight


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    scale_in_tile: bool = False   # see _dequant_dot


# Up to SMALL_MAX_M tokens (past the decode kernels' ops.moe_int4.decode_max_m(): an expert cache's short chunks):
# the fewest rows tl.dot takes and wide N tiles — the best of scripts/gpu_moe.py's 13-config H200 sweep at every M
# of 16–128 (session 14, cd6b6ac, Flash-Next, per layer in a graph: 394 / 590 / 810 / 1021 µs at M = 16 / 32 / 64 / 128,
# against 442 / 702 / 1007 / 1296 for the earlier 32-wide tiles and 517 / 821 / 1172 / 1483 for PREFILL's);
# prefill: tensor-core-sized tiles, the scale in the tile (the best of scripts/gpu_prefill_gemm.py's 18-config
# H200 sweep at 8,192 tokens, 2026-11-30: 5.0 ms per Flash-Next layer, 161 TFLOP/s, vs 5.8 ms with the scale on
# each K tile's partial).
SMALL = MoeConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=4)
SMALL_MAX_M = 128
PREFILL = MoeConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4, scale_in_tile=True)


@triton.jit
def _int4_tile(qweight_ptr, k0, offs_n, n_ok, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows k0 .. k0+BLOCK_K of one expert's [K, N] nibbles as int32 [BLOCK_K, BLOCK_N] (values 0..15).

    Each packed word is loaded once and split in registers (row 8i+j is nibble j of word i)."""
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(qweight_ptr + words[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    nibbles = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
    return tl.reshape(nibbles, (BLOCK_K, BLOCK_N))


@triton.jit
def _dequant_dot(acc, a, qweight_ptr, scales_ptr, zeros_ptr, k0, group_size, offs_n, n_ok, N,
                 HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr, SCALE_IN_TILE: tl.constexpr):
    """acc + a @ W[k0:k0+BLOCK_K, offs_n] for one expert, the tile inside one quantisation group.

    Default: the exact integers (q - zero) go into the dot and the fp32 partial is scaled. SCALE_IN_TILE: the
    tile is scaled (rounded to a's dtype) and the dot accumulates straight into acc, which lets Hopper chain its
    asynchronous MMAs across K tiles instead of waiting for each partial (scripts/gpu_prefill_gemm.py times both)."""
    group = k0 // group_size
    q = _int4_tile(qweight_ptr, k0, offs_n, n_ok, N, BLOCK_K, BLOCK_N)
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + group * N + offs_n, mask=n_ok, other=0).to(tl.int32)
    else:
        zero = tl.full((BLOCK_N,), 8, tl.int32)
    scale = tl.load(scales_ptr + group * N + offs_n, mask=n_ok, other=0).to(tl.float32)
    if SCALE_IN_TILE:
        w = ((q - zero[None, :]).to(tl.float32) * scale[None, :]).to(a.dtype)
        return tl.dot(a, w, acc, input_precision=PRECISION)
    partial = tl.dot(a, (q - zero[None, :]).to(a.dtype), input_precision=PRECISION)
    return acc + partial * scale[None, :]


@triton.jit
def _columns(perm_ptr, k0, offs_k, HAS_PERM: tl.constexpr):
    """The activation columns packed rows k0.. multiply: act-order weights gather them through perm."""
    if HAS_PERM:
        return tl.load(perm_ptr + k0 + offs_k)
    return k0 + offs_k


@triton.jit
def _block_rows(start, sorted_ids_ptr, order_ptr, n_pairs, BLOCK_M: tl.constexpr):
    """The rows of the block of sorted pairs that starts at `start`: (expert, rows, row mask, pair ids)."""
    expert = tl.load(sorted_ids_ptr + start)
    rows = start + tl.arange(0, BLOCK_M)
    ok = rows < n_pairs
    # Rows past the end of this expert's run belong to the next block: the expert test masks them.
    ok = ok & (tl.load(sorted_ids_ptr + rows, mask=ok, other=-1) == expert)
    pair = tl.load(order_ptr + rows, mask=ok, other=0)
    return expert.to(tl.int64), rows, ok, pair


@triton.jit(do_not_specialize=["n_pairs"])
def _gate_up_kernel(x_ptr, h_ptr, sorted_ids_ptr, order_ptr, block_start_ptr,
                    qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, n_pairs, H, I, group_size,
                    TOP_K: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, PRECISION: tl.constexpr,
                    SCALE_IN_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    start = tl.load(block_start_ptr + tl.program_id(0))
    if start < 0:  # a spare entry of the block table
        return
    expert, rows, ok, pair = _block_rows(start, sorted_ids_ptr, order_ptr, n_pairs, BLOCK_M)
    N = 2 * I
    qweight_ptr += expert * (H // 8) * N
    scales_ptr += expert * (H // group_size) * N
    zeros_ptr += expert * (H // group_size) * N
    perm_ptr += expert * H
    token = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        cols = _columns(perm_ptr, k0, offs_k, HAS_PERM)
        a = tl.load(x_ptr + token[:, None] * H + cols[None, :], mask=ok[:, None], other=0)
        gate = _dequant_dot(gate, a, qweight_ptr, scales_ptr, zeros_ptr, k0, group_size, offs_n, n_ok, N,
                            HAS_ZEROS, BLOCK_K, BLOCK_N, PRECISION, SCALE_IN_TILE)
        up = _dequant_dot(up, a, qweight_ptr, scales_ptr, zeros_ptr, k0, group_size, I + offs_n, n_ok, N,
                          HAS_ZEROS, BLOCK_K, BLOCK_N, PRECISION, SCALE_IN_TILE)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + rows[:, None] * I + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["n_pairs"])
def _down_kernel(h_ptr, y_ptr, topk_weights_ptr, sorted_ids_ptr, order_ptr, block_start_ptr,
                 qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, n_pairs, H, I, group_size,
                 HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, PRECISION: tl.constexpr,
                 SCALE_IN_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    start = tl.load(block_start_ptr + tl.program_id(0))
    if start < 0:  # a spare entry of the block table
        return
    expert, rows, ok, pair = _block_rows(start, sorted_ids_ptr, order_ptr, n_pairs, BLOCK_M)
    qweight_ptr += expert * (I // 8) * H
    scales_ptr += expert * (I // group_size) * H
    zeros_ptr += expert * (I // group_size) * H
    perm_ptr += expert * I
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        cols = _columns(perm_ptr, k0, offs_k, HAS_PERM)
        a = tl.load(h_ptr + rows[:, None] * I + cols[None, :], mask=ok[:, None], other=0)
        acc = _dequant_dot(acc, a, qweight_ptr, scales_ptr, zeros_ptr, k0, group_size, offs_n, n_ok, H,
                           HAS_ZEROS, BLOCK_K, BLOCK_N, PRECISION, SCALE_IN_TILE)
    weight = tl.load(topk_weights_ptr + pair, mask=ok, other=0).to(tl.float32)
    tl.store(y_ptr + pair[:, None] * H + offs_n[None, :], acc * weight[:, None], mask=ok[:, None] & n_ok[None, :])


def default_config(m: int) -> MoeConfig:
    """The tiles for m tokens: SMALL up to SMALL_MAX_M, PREFILL above."""
    return SMALL if m <= SMALL_MAX_M else PREFILL


def block_k_for_group(config_k: int, group_size: int) -> int:
    """The largest power of two <= config_k dividing the group size (which divides K): tiles stay in one group."""
    bk = config_k
    while bk > 16 and group_size % bk:
        bk //= 2
    if group_size % bk:
        raise ValueError(f"the INT4 MoE kernels need a group size divisible by 16, got {group_size}")
    return bk


def moe_int4_triton(x, topk_ids, topk_weights, w_gate_up: Int4Weight, w_down: Int4Weight,
                    config: MoeConfig | None = None) -> torch.Tensor:
    """Same contract as ops.moe_int4.moe_int4_reference; x [M, H] bf16/fp16/fp32 on CUDA (or interpreted)."""
    return moe_int4_triton_pairs(x, topk_ids, topk_weights, w_gate_up, w_down, config).sum(1).to(x.dtype)


def moe_int4_triton_pairs(x, topk_ids, topk_weights, w_gate_up: Int4Weight, w_down: Int4Weight,
                          config: MoeConfig | None = None) -> torch.Tensor:
    """The weighted terms [M, k, H] fp32 that moe_int4_triton sums over k (ops.moe_int4.routed_pairs)."""
    m, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, _, two_i = w_gate_up.qweight.shape
    inter = two_i // 2
    config = config or default_config(m)
    x = x.contiguous()
    plan = expert_order(topk_ids, num_experts, config.block_m)
    sorted_ids, order, block_start = plan.sorted_ids, plan.order, plan.block_start
    n_pairs = topk_ids.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(n_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n_pairs, hidden, dtype=torch.float32, device=x.device)
    common = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, PRECISION=precision,
                  SCALE_IN_TILE=config.scale_in_tile,
                  num_warps=config.num_warps, num_stages=config.num_stages)

    def optional(w):  # zeros and perm, or a dummy pointer never read (HAS_ZEROS/HAS_PERM are constexprs)
        return (w.scales if w.zeros is None else w.zeros, w.qweight if w.perm is None else w.perm,
                dict(HAS_ZEROS=w.zeros is not None, HAS_PERM=w.perm is not None))

    grid = (block_start.numel(), triton.cdiv(inter, config.block_n))
    zeros, perm, flags = optional(w_gate_up)
    _gate_up_kernel[grid](
        x, h, sorted_ids, order, block_start, w_gate_up.qweight, w_gate_up.scales, zeros, perm,
        n_pairs, hidden, inter, w_gate_up.group_size, TOP_K=top_k,
        BLOCK_K=block_k_for_group(config.block_k, w_gate_up.group_size), **flags, **common)
    grid = (block_start.numel(), triton.cdiv(hidden, config.block_n))
    zeros, perm, flags = optional(w_down)
    _down_kernel[grid](
        h, y, topk_weights.reshape(-1).contiguous(), sorted_ids, order, block_start,
        w_down.qweight, w_down.scales, zeros, perm, n_pairs, hidden, inter, w_down.group_size,
        BLOCK_K=block_k_for_group(config.block_k, w_down.group_size), **flags, **common)
    return y.view(m, top_k, hidden)
