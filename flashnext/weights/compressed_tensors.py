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

from .int4 import pack_int32, unpack_int32
from .int4_layout import Int4Weight, from_rows

PACKED, SCALE, SHAPE, ZERO_POINT, G_IDX = "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", \
    "weight_g_idx"
PARTS = (PACKED, SCALE, SHAPE, ZERO_POINT, G_IDX)
REQUIRED = (PACKED, SCALE, SHAPE)
UNPACKED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")
# an unpacked weight's tensors: read (the weight itself is X.weight), and those only counted as used (activations)
UNPACKED_PARTS, ACTIVATION_PARTS = (SCALE, ZERO_POINT, G_IDX), ("input_scale", "input_zero_point")


def bits_of(packed_shape: tuple[int, ...], shape: tuple[int, int]) -> int:
    """The bit width a [N, K] weight packed into `packed_shape` words has (0 where no supported width fits)."""
    num_out, num_in = shape
    if len(packed_shape) != 2 or packed_shape[0] != num_out or not num_in:
        return 0
    bits = 32 * packed_shape[1] // num_in
    return bits if bits in (4, 8) and packed_shape[1] * 32 == bits * num_in else 0


def _groups(parts: dict[str, torch.Tensor], num_in: int) -> torch.Tensor:
    """G(k) for every input k (long)."""
    scale = parts[SCALE]
    if G_IDX in parts:
        return parts[G_IDX].to(device=scale.device, dtype=torch.long)
    if num_in % scale.shape[1]:
        raise ValueError(f"{scale.shape[1]} scale groups do not divide {num_in} inputs")
    return torch.arange(num_in, device=scale.device) // (num_in // scale.shape[1])


def _shape(parts: dict[str, torch.Tensor]) -> tuple[int, int]:
    num_out, num_in = (int(v) for v in parts[SHAPE].tolist())
    return num_out, num_in


def _zero_points(parts: dict[str, torch.Tensor], bits: int, num_out: int) -> torch.Tensor | None:
    """The stored (offset) zero points [N, K/g], or None (symmetric)."""
    if ZERO_POINT not in parts:
        return None
    return unpack_int32(parts[ZERO_POINT].to(torch.int32), bits, dim=0)[:num_out]


def dequantize(parts: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """A layer's tensors (named by PARTS without the module prefix) → fp32 [N, K]."""
    num_out, num_in = _shape(parts)
    codes = unpack_int32(parts[PACKED].to(torch.int32), bits, dim=1)[:, :num_in]
    zeros = _zero_points(parts, bits, num_out)
    groups = _groups(parts, num_in)
    zero = (1 << (bits - 1)) if zeros is None else zeros[:, groups]
    return parts[SCALE].float()[:, groups] * (codes - zero).float()


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
    """An fp8 or int8 weight [N, K] and its UNPACKED_PARTS (named without the module prefix; `block`: the config's
    block_structure, for the block strategy) → fp32 [N, K]."""
    num_out, num_in = weight.shape
    scale, zero = parts[SCALE].float(), parts.get(ZERO_POINT)
    if G_IDX in parts:        # act-order groups: column k's scale is its group's
        groups = parts[G_IDX].to(device=scale.device, dtype=torch.long)
        expand = (lambda t: t.reshape(num_out, -1)[:, groups])  # noqa: E731
    elif scale.numel() == 1:
        expand = (lambda t: t.reshape(()))  # noqa: E731
    else:
        rows, cols = scale.reshape(scale.shape[0], -1).shape
        if block is None and (num_out % rows or num_in % cols):
            raise ValueError(f"weight_scale {tuple(scale.shape)} does not fit weight {tuple(weight.shape)}")
        rows, cols = block or (num_out // rows, num_in // cols)
        if (-(-num_out // rows), -(-num_in // cols)) != tuple(scale.reshape(scale.shape[0], -1).shape):
            raise ValueError(f"weight_scale {tuple(scale.shape)} does not fit weight {tuple(weight.shape)} "
                             f"in blocks of {rows} x {cols}")
        expand = (lambda t: t.reshape(t.shape[0], -1).repeat_interleave(rows, 0)  # noqa: E731
                  .repeat_interleave(cols, 1)[:num_out, :num_in])
    w = weight.float()
    if zero is not None:
        w = w - expand(zero.float())
    return w * expand(scale)


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, sym: bool = True,
                 scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Round-to-nearest 4-bit quantisation of `weight` [N, K] in this format (synthetic checkpoints): symmetric,
    scale = amax / 7 per group (q in [-7, 7]); asymmetric, scale = (max − min) / 15 and a zero point in [-8, 7]."""
    num_out, num_in = weight.shape
    if num_in % group_size or num_out % 8:
        raise ValueError(f"cannot quantise a [{num_out}, {num_in}] weight to 4 bits in groups of {group_size}")
    groups = weight.detach().float().reshape(num_out, num_in // group_size, group_size)
    if sym:
        scale = (groups.abs().amax(-1) / 7).to(scale_dtype)
        zero = torch.zeros(scale.shape, dtype=torch.int64)
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).to(scale_dtype)
        zero = torch.round(-8 - lo / torch.where(scale == 0, 1, scale.float())).to(torch.int64).clamp(-8, 7)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(groups / scale.float()[..., None] + zero[..., None]).to(torch.int64).clamp(-8, 7)
    tensors = {PACKED: pack_int32(q.reshape(num_out, num_in) + 8, 4, dim=1), SCALE: scale,
               SHAPE: torch.tensor([num_out, num_in])}
    if not sym:
        tensors[ZERO_POINT] = pack_int32(zero + 8, 4, dim=0)
    return tensors
