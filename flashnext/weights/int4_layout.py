"""The INT4 kernel layout (docs/int4.md): what W4A16 and INT4 MoE kernels read.

For W [N, K] (out x in), group size g:
  qweight int32 [K/8, N]   input row 8i+j in nibble j of qweight[i] (low nibble first: the auto_gptq packing)
  scales  float [K/g, N]   bf16 when we quantise; a checkpoint's fp16 scales are kept as they are
  zeros   uint8 [K/g, N]   the zero point itself, unpacked; None: symmetric (zero 8)
  perm    int32 [K]        act-order: packed row k multiplies activation column perm[k]; None: identity
W[n, perm[k]] = scales[k // g, n] * (q[k, n] - zero[k // g, n]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .int4 import pack_int32, unpack_int32

SYMMETRIC_ZERO = 8


@dataclass
class Int4Weight:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qweight.shape[-2] * 8

    @property
    def out_features(self) -> int:
        return self.qweight.shape[-1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that exist (for buffers and byte counts)."""
        named = {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros, "perm": self.perm}
        return {k: v for k, v in named.items() if v is not None}

    def to(self, device) -> Int4Weight:
        moved = {k: v.to(device) for k, v in self.tensors().items()}
        return Int4Weight(moved["qweight"], moved["scales"], moved.get("zeros"), moved.get("perm"), self.group_size)


def _check_shape(num_out: int, num_in: int, group_size: int) -> None:
    if group_size % 8 or num_in % group_size or num_out % 8:
        raise ValueError(f"cannot hold a [{num_out}, {num_in}] weight in int4 with group size {group_size}: "
                         "K must be a multiple of the group size, and the group size and N multiples of 8")


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype = torch.bfloat16,
                 sym: bool = True) -> Int4Weight:
    """Round-to-nearest int4 of `weight` [N, K], the scale rounded to `scale_dtype` *before* the codes are chosen, so
    the codes are the nearest for the scale kernels will see. Symmetric: scale = amax / 7 per (group, output), zero 8;
    asymmetric: scale = (max − min) / 15 (the range widened to hold 0) and a zero point in [0, 15]."""
    num_out, num_in = weight.shape
    _check_shape(num_out, num_in, group_size)
    groups = weight.detach().float().t().reshape(num_in // group_size, group_size, num_out)
    if sym:
        scales = (groups.abs().amax(1) / 7).to(scale_dtype)
    else:
        lo, hi = groups.amin(1).clamp(max=0), groups.amax(1).clamp(min=0)
        scales = ((hi - lo) / 15).to(scale_dtype)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    zeros = (torch.full(scales.shape, SYMMETRIC_ZERO, dtype=torch.int64, device=scales.device) if sym
             else torch.round(-lo / scales.float()).to(torch.int64).clamp(0, 15))
    q = (torch.round(groups / scales.float().unsqueeze(1)) + zeros.unsqueeze(1)).clamp(0, 15).to(torch.int64)
    return Int4Weight(pack_int32(q.reshape(num_in, num_out), 4, dim=0), scales,
                      None if sym else zeros.to(torch.uint8), None, group_size)


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    sym: bool = True,
    *,
    zeros_minus_one: bool = True,
) -> Int4Weight:
    """A 4-bit auto_gptq layer (qweight [K/8, N], qzeros [K/g, N/8], scales [K/g, N], g_idx [K]) → Int4Weight
    (`from_rows`; `zeros_minus_one`: the gptq v1 convention, zero points stored minus one)."""
    num_out = qweight.shape[1]
    zeros = unpack_int32(qzeros, 4, dim=1)[:, :num_out]
    if zeros_minus_one:
        # auto_gptq adds the 1 back after the 4-bit mask, so a stored 15 is a zero of 16.
        zeros = zeros + 1
    return from_rows(qweight, zeros, scales, g_idx, sym, source="GPTQ")


def from_rows(qweight: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor, g_idx: torch.Tensor | None,
              sym: bool, source: str) -> Int4Weight:
    """4-bit codes already in the kernel layout's words (qweight [K/8, N]), the zero points themselves ([K/g, N],
    unpacked; None: symmetric) and scales [K/g, N] of a `source` checkpoint → Int4Weight.

    Monotone `g_idx` (or none): qweight is used as is. Act-order `g_idx`: rows are sorted by group and
    repacked, and the sort order becomes `perm`. Zeros that are all 8 (symmetric, whatever `sym` says)
    are dropped so the kernels take their symmetric path; `sym=True` with other zeros is refused.
    """
    num_in, num_out = qweight.shape[0] * 8, qweight.shape[1]
    num_groups = scales.shape[0]
    if scales.shape[1] != num_out or num_in % num_groups:
        raise ValueError(f"{source} scales {tuple(scales.shape)} do not fit qweight {tuple(qweight.shape)}")
    group_size = num_in // num_groups
    _check_shape(num_out, num_in, group_size)
    if zeros is not None:
        if tuple(zeros.shape) != tuple(scales.shape):
            raise ValueError(f"{source} zero points {tuple(zeros.shape)} do not fit scales {tuple(scales.shape)}")
        if bool((zeros == SYMMETRIC_ZERO).all()):
            zeros = None
        elif sym:
            raise ValueError(f"{source} layer declared symmetric has zero points other than 8")
        else:
            zeros = zeros.to(torch.uint8).contiguous()
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(device=qweight.device, dtype=torch.long)
        if not torch.equal(g_idx, torch.arange(num_in, device=qweight.device) // group_size):
            counts = torch.bincount(g_idx, minlength=num_groups)
            if g_idx.min() < 0 or counts.numel() != num_groups or bool((counts != group_size).any()):
                raise ValueError(f"{source} g_idx does not put exactly {group_size} input rows in each of the "
                                 f"{num_groups} groups; this act-order layout is not supported")
            perm = torch.sort(g_idx, stable=True).indices
            q = unpack_int32(qweight, 4, dim=0)[perm]
            qweight = pack_int32(q, 4, dim=0)
            perm = perm.to(torch.int32)
    return Int4Weight(qweight.contiguous(), scales.contiguous(), zeros, perm, group_size)


def dequantize(w: Int4Weight) -> torch.Tensor:
    """Int4Weight → fp32 [N, K] (or [E, N, K] for stacked experts), in the original input order."""
    q = unpack_int32(w.qweight, 4, dim=-2)                       # [..., K, N]
    zeros = SYMMETRIC_ZERO if w.zeros is None else w.zeros.to(torch.int32).repeat_interleave(w.group_size, dim=-2)
    scales = w.scales.float().repeat_interleave(w.group_size, dim=-2)
    packed_order = (scales * (q - zeros).float()).transpose(-1, -2)    # [..., N, K] in packed row order
    if w.perm is None:
        return packed_order.contiguous()
    out = torch.empty_like(packed_order)
    index = w.perm.long().unsqueeze(-2).expand_as(packed_order)
    return out.scatter_(-1, index, packed_order)
