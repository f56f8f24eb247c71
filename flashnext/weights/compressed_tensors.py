"""compressed-tensors weights (llm-compressor's exports: the W4A16 AWQ and GPTQ releases of Qwen3-Next and Qwen3.5/3.6
MoE, their FP8-dynamic and INT8 W8A8 ones, which vLLM serves as compressed-tensors).

`pack-quantized` (4- and 8-bit integers packed into int32 words):
One quantised linear layer `X` with K inputs, N outputs, b bits (4 or 8: no value straddles a word), groups of g
inputs (strategy "group"; "channel": g = K) stores
  X.weight_packed      int32 [N, K·b/32]   input k of row n in bits [b·(k mod 32/b), …) of word k // (32/b),
                                            lowest first, each value stored as q + 2**(b-1)
  X.weight_scale       float [N, K/g]
  X.weight_shape       int   [2]           (N, K)
  X.weight_zero_point  int32 [N·b/32, K/g] asymmetric only: the zero points packed the same way along N, offset too
  X.weight_g_idx       int   [K]           older exports with actorder "group": the group of input k
and w[n, k] = scale[n, G(k)] · (u[n, k] − uz[n, G(k)]), u and uz the stored (offset) values, uz = 2**(b-1) when
symmetric, G(k) = g_idx[k] or k // g — compressed_tensors' own decompress, which the tests hold this against.
At 4 bits the words are the kernel layout's transposed (nibble j of word i is input 8i + j in both, and the offset
values are its codes with zero 8): the packed form (`to_int4`) only transposes.

`float-quantized` / `int-quantized` / `naive-quantized` (one fp8 or int8 value per weight, `dequantize_unpacked`):
  X.weight             fp8 or int8 [N, K]
  X.weight_scale       float [1] (tensor), [N, 1] (channel), [N, K/g] (group) or [ceil(N/bn), ceil(K/bk)] (block)
  X.weight_zero_point  int8, the scale's shape: asymmetric only (not offset here)
  X.input_scale, X.input_zero_point   static activation quantisation, which flashnext does not apply
and w = scale · (weight − zero point), each scale over its tensor, row, group or block.
"""
from __future__ import annotations

import torch

from .fp8 import expand_block_scale
from .int4 import pack_int32, unpack_int32
from .int4_layout import Int4Weight, from_rows, quantize_rtn as quantize_int4_rtn

PACKED, SCALE, SHAPE, ZERO_POINT, G_IDX = "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", \
    "weight_g_idx"
PARTS = (PACKED, SCALE, SHAPE, ZERO_POINT, G_IDX)
REQUIRED = (PACKED, SCALE, SHAPE)
# an unpacked weight's tensors: read (the weight itself is X.weight), and those only counted as used (activations)
UNPACKED_PARTS, ACTIVATION_PARTS = (SCALE, ZERO_POINT, G_IDX), ("input_scale", "input_zero_point")


def bits_of(packed_shape: tuple[int, ...], shape: tuple[int, int]) -> int:
    """The bit width a [N, K] weight packed into `packed_shape` words has (0 where no supported width fits)."""
    num_out, num_in = shape
    if len(packed_shape) != 2 or packed_shape[0] != num_out or not num_in:
        return 0
    bits = 32 * packed_shape[1] // num_in
    return bits if bits in (4, 8) and packed_shape[1] * 32 == bits * num_in else 0


def _shape(parts: dict[str, torch.Tensor]) -> tuple[int, int]:
    num_out, num_in = (int(v) for v in parts[SHAPE].tolist())
    return num_out, num_in


def _zero_points(parts: dict[str, torch.Tensor], bits: int, num_out: int) -> torch.Tensor | None:
    """The stored (offset) zero points [N, K/g], or None (symmetric)."""
    if ZERO_POINT not in parts:
        return None
    return unpack_int32(parts[ZERO_POINT].to(torch.int32), bits, dim=0)[:num_out]


def dequantize(parts: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """A layer's tensors (named by PARTS without the module prefix) → fp32 [N, K]: its stored values unpacked, then
    `dequantize_unpacked` (the zero point of a symmetric layer: the storage offset 2**(bits-1))."""
    num_out, num_in = _shape(parts)
    codes = unpack_int32(parts[PACKED].to(torch.int32), bits, dim=1)[:, :num_in]
    zeros = _zero_points(parts, bits, num_out)
    if zeros is None:
        zeros = torch.full(parts[SCALE].shape, 1 << (bits - 1), dtype=torch.int32, device=codes.device)
    return dequantize_unpacked(codes, {**parts, ZERO_POINT: zeros})


def to_int4(parts: dict[str, torch.Tensor]) -> Int4Weight:
    """A 4-bit layer's tensors → Int4Weight (the kernel layout; act-order g_idx becomes its perm)."""
    num_out, num_in = _shape(parts)
    packed = parts[PACKED].to(torch.int32)
    if tuple(packed.shape) != (num_out, num_in // 8):
        raise ValueError(f"weight_packed {tuple(packed.shape)} does not hold a 4-bit [{num_out}, {num_in}] weight")
    zeros = _zero_points(parts, 4, num_out)
    return from_rows(packed.t().contiguous(), None if zeros is None else zeros.t(), parts[SCALE].t(),
                     parts.get(G_IDX), sym=zeros is None, source="compressed-tensors")


def dequantize_unpacked(weight: torch.Tensor, parts: dict[str, torch.Tensor],
                        block: tuple[int, int] | None = None) -> torch.Tensor:
    """Weight values [N, K] (fp8 or integers) and their UNPACKED_PARTS (named without the module prefix) → fp32 [N, K]:
    scale · (value − zero point), the scale by tensor, row, group (or act-order group: weight_g_idx) or `block` (the
    config's block_structure, where the scale has that shape). The shapes are checked where the checkpoint is planned
    (compressed_tensors_plan.py)."""
    num_out, num_in = weight.shape
    scale, zero = parts[SCALE].float(), parts.get(ZERO_POINT)
    if G_IDX in parts:        # act-order groups: column k's scale is its group's
        groups = parts[G_IDX].to(device=scale.device, dtype=torch.long)
        expand = (lambda t: t.reshape(num_out, -1)[:, groups])  # noqa: E731
    elif scale.numel() == 1:
        expand = (lambda t: t.reshape(()))  # noqa: E731
    else:
        rows, cols = scale.reshape(scale.shape[0], -1).shape
        block = block or (num_out // rows, num_in // cols)
        expand = (lambda t: expand_block_scale(t.reshape(rows, cols), weight.shape, block))  # noqa: E731
    w = weight.float()
    if zero is not None:
        w = w - expand(zero.float())
    return w * expand(scale)


def from_int4(w: Int4Weight) -> dict[str, torch.Tensor]:
    """The inverse of `to_int4` (not act-order): an Int4Weight as a 4-bit layer's tensors."""
    assert w.perm is None, "act-order weights are stored with weight_g_idx"
    parts = {PACKED: w.qweight.t().contiguous(), SCALE: w.scales.t().contiguous(),
             SHAPE: torch.tensor([w.out_features, w.in_features])}
    if w.zeros is not None:
        parts[ZERO_POINT] = pack_int32(w.zeros.t().to(torch.int64), 4, dim=0)
    return parts


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, sym: bool = True,
                 scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Round-to-nearest 4-bit quantisation of `weight` [N, K] in this format (synthetic checkpoints): the kernel
    layout's (int4_layout.quantize_rtn) as a layer's tensors."""
    return from_int4(quantize_int4_rtn(weight, group_size, scale_dtype, sym))
