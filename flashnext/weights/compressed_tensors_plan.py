"""The compressed-tensors weights of a checkpoint, planned from the safetensors headers (weights/checkpoint.py's
_Planner asks): which tensors a quantised module stores, their shapes and dtypes checked against the module's
before a byte of data is read, and how the weight is built from them (weights/compressed_tensors.py).

`tensors` is the checkpoint's tensor index (has / shape / dtype / read / use); a problem raises ValueError naming
what is wrong, which the planner reports as a CheckpointError.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from . import compressed_tensors as ct
from .int4_layout import Int4Weight

Build = Callable[[], "torch.Tensor | Int4Weight"]


def _names(tensors, base: str, parts: tuple[str, ...]) -> dict[str, str]:
    return {part: f"{base}.{part}" for part in parts if tensors.has(f"{base}.{part}")}


def _groups_of(tensors, names: dict[str, str], base: str, shape: tuple[int, int]) -> int:
    """The scale groups along the inputs of a [N, K] weight whose scale is [N, G] (K a multiple of G) → G."""
    num_out, num_in = shape
    scale = tensors.shape(names[ct.SCALE])
    if len(scale) != 2 or scale[0] != num_out or not scale[1] or num_in % scale[1]:
        raise ValueError(f"{base}.weight_scale {scale} does not fit a [{num_out}, {num_in}] weight (expected "
                         f"[{num_out}, groups], the groups dividing {num_in})")
    if ct.G_IDX in names and tensors.shape(names[ct.G_IDX]) != (num_in,):
        raise ValueError(f"{base}.weight_g_idx {tensors.shape(names[ct.G_IDX])} is not one group an input ({num_in})")
    return scale[1]


def plan_packed(tensors, base: str, shape: tuple[int, ...], keep_packed: bool, device) -> tuple[list[str], Build]:
    """`base.weight_packed` and its parts → (the tensors read, the builder): an Int4Weight where `keep_packed` and the
    weight is 4-bit, else the dequantised fp32 weight."""
    names = _names(tensors, base, ct.PARTS)
    absent = [part for part in ct.REQUIRED if part not in names]
    if absent:
        raise ValueError(f"compressed-tensors weight {base} comes without its {', '.join(absent)}")
    packed_shape = tensors.shape(names[ct.PACKED])
    bits = ct.bits_of(packed_shape, shape) if len(shape) == 2 else 0
    if not bits or tensors.dtype(names[ct.PACKED]) != torch.int32:
        raise ValueError(f"tensor {base} (compressed-tensors) has the wrong shape: expected {tuple(shape)} in 4 or 8 "
                         f"bits, got {packed_shape} {tensors.dtype(names[ct.PACKED])} packed words")
    groups = _groups_of(tensors, names, base, shape)
    if ct.ZERO_POINT in names:
        packed_zeros = (-(-shape[0] * bits // 32), groups)
        got = tensors.shape(names[ct.ZERO_POINT])
        if got != packed_zeros or tensors.dtype(names[ct.ZERO_POINT]) != torch.int32:
            raise ValueError(f"{base}.weight_zero_point {got} {tensors.dtype(names[ct.ZERO_POINT])} is not packed "
                             f"(expected int32 {packed_zeros}; exports from before compressed-tensors packed zero "
                             "points are not supported)")

    def build() -> torch.Tensor | Int4Weight:
        parts = {part: tensors.read(name, device) for part, name in names.items()}
        if tuple(int(v) for v in parts[ct.SHAPE].tolist()) != tuple(shape):
            raise ValueError(f"tensor {base} (compressed-tensors) has the wrong shape: expected {tuple(shape)}, its "
                             f"weight_shape says {parts[ct.SHAPE].tolist()}")
        return ct.to_int4(parts) if keep_packed and bits == 4 else ct.dequantize(parts, bits)

    return [tensors.use(n) for n in names.values()], build


def plan_unpacked(tensors, name: str, base: str, block: tuple[int, int] | None, device) -> tuple[list[str], Build]:
    """An fp8 or int8 weight `name` (= base.weight) with its scale, zero point and act-order groups → (the tensors
    it reads and its static activation scales, counted as used but never applied; the builder of the dequantised
    fp32 weight). `block`: the config's block_structure, taken where the scale has that block shape."""
    num_out, num_in = shape = tensors.shape(name)
    if tensors.dtype(name) not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"{name} is {tensors.dtype(name)}, not the fp8 or int8 of a compressed-tensors weight")
    names = _names(tensors, base, ct.UNPACKED_PARTS)
    unread = list(_names(tensors, base, ct.ACTIVATION_PARTS).values())
    scale = tensors.shape(names[ct.SCALE])
    if block is not None and scale != (-(-num_out // block[0]), -(-num_in // block[1])):
        block = None          # another group's strategy: by tensor, row or group
    if block is None and ct.G_IDX in names:
        _groups_of(tensors, names, base, shape)
    elif block is None and math.prod(scale) != 1:
        rows, cols = (scale[0], 1) if len(scale) == 1 else scale if len(scale) == 2 else (0, 0)
        if not rows or not cols or num_out % rows or num_in % cols:
            raise ValueError(f"{base}.weight_scale {scale} does not fit a {list(shape)} weight by tensor, row, "
                             "group or block")
    if ct.ZERO_POINT in names and tensors.shape(names[ct.ZERO_POINT]) != scale:
        raise ValueError(f"{base}.weight_zero_point {tensors.shape(names[ct.ZERO_POINT])} does not match its "
                         f"weight_scale {scale}")

    def build() -> torch.Tensor:
        parts = {part: tensors.read(n, device) for part, n in names.items()}
        return ct.dequantize_unpacked(tensors.read(name, device), parts, block)

    return [tensors.use(n) for n in (name, *names.values(), *unread)], build

