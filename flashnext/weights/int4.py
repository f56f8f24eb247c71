"""GPTQ / AutoRound INT4 weights in the auto_gptq packing.

Layout of one quantised linear layer with K inputs, N outputs, group size g (bits b, p = 32 // b values per int32):
  qweight int32 [K/p, N]    input row p*i+j sits in bits [b*j, b*j+b) of qweight[i] (lowest bits first)
  qzeros  int32 [K/g, N/p]  the zero points, packed the same way along N, storing zero - 1 (gptq v1)
  scales  fp16  [K/g, N]
  g_idx   int32 [K]         optional: the group of input row k (not monotone when quantised with desc_act)
w[n, k] = scales[G(k), n] * (q[k, n] - zero[G(k), n]), G(k) = g_idx[k] or k // g. Symmetric 4-bit stores
zero 7, i.e. a real zero of 8.
"""

from __future__ import annotations

import torch


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    if 32 % bits:
        raise ValueError(f"cannot unpack {bits}-bit values from int32 words")
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unpack the 32 // bits values of every int32 along `dim` (value j of a word in bits [bits*j, bits*(j+1)))."""
    shifts = _shifts(bits, packed.device)
    packed = packed.movedim(dim, -1)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2).movedim(-1, dim)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `unpack_int32`: values in [0, 2**bits) along `dim` (length divisible by 32 // bits)."""
    per_word = 32 // bits
    shifts = _shifts(bits, values.device)
    values = values.movedim(dim, -1).to(torch.int64)
    if values.shape[-1] % per_word:
        raise ValueError(f"cannot pack {values.shape[-1]} values into int32 words of {per_word}")
    words = (values.unflatten(-1, (-1, per_word)) << shifts.to(torch.int64)).sum(-1)
    # Words above 2**31 wrap to negative int32, exactly what the int32 bit pattern is.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    bits: int = 4,
    *,
    zeros_minus_one: bool = True,
) -> torch.Tensor:
    """Dequantise one GPTQ layer to fp32 [N, K] (nn.Linear layout: out x in).

    `zeros_minus_one` is the gptq v1 convention (auto_gptq, AutoRound "auto_round:auto_gptq"); gptq v2
    checkpoints (gptqmodel) store the zero point itself.
    """
    q = unpack_int32(qweight, bits, dim=0)  # [K, N]
    zeros = unpack_int32(qzeros, bits, dim=1)  # [K/g, N]
    if zeros_minus_one:
        # auto_gptq adds the 1 back after masking, so a stored 2**bits - 1 means a zero of 2**bits.
        zeros = zeros + 1
    num_inputs = q.shape[0]
    if g_idx is None:
        group_size = num_inputs // scales.shape[0]
        g_idx = torch.arange(num_inputs, device=q.device) // group_size
    else:
        g_idx = g_idx.to(device=q.device, dtype=torch.long)
    weight = scales.float()[g_idx] * (q - zeros[g_idx]).float()
    return weight.t().contiguous()


def quantize_gptq_rtn(
    weight: torch.Tensor,
    group_size: int = 128,
    sym: bool = True,
    *,
    desc_act_perm: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Round-to-nearest 4-bit GPTQ quantisation of `weight` [N, K] (out x in).

    Symmetric: scale = amax / 7 per group so q - 8 spans [-7, 7] and nothing clips; dequantising and
    quantising again reproduces the same tensors. Asymmetric: scale = (max - min) / 15, zero in [1, 15]
    (gptq v1 cannot store a zero of 0). `desc_act_perm` (a permutation of the K inputs) forms the groups
    in that order, as GPTQ's act-order does, and adds the resulting non-monotone `g_idx`.
    """
    num_out, num_in = weight.shape
    if num_in % group_size or num_in % 8 or num_out % 8:
        raise ValueError(f"cannot quantise a [{num_out}, {num_in}] weight to int4 with group size {group_size}")
    w = weight.detach().float().t()  # [K, N]
    if desc_act_perm is not None:
        w = w[desc_act_perm]
    groups = w.reshape(num_in // group_size, group_size, num_out)
    if sym:
        scales = (groups.abs().amax(1) / 7).to(torch.float16)
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    else:
        lo = groups.amin(1).clamp(max=0)
        hi = groups.amax(1).clamp(min=0)
        scales = ((hi - lo) / 15).to(torch.float16)
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        zeros = torch.round(-lo / scales.float()).to(torch.int64).clamp(1, 15)
    q = torch.round(groups / scales.float().unsqueeze(1)).to(torch.int64) + zeros.unsqueeze(1)
    q = q.clamp(0, 15).reshape(num_in, num_out)
    result = {"scales": scales, "qzeros": pack_int32(zeros - 1, 4, dim=1)}
    if desc_act_perm is None:
        result["qweight"] = pack_int32(q, 4, dim=0)
    else:
        # Rows were quantised in permuted order; put them back so qweight row k is input k.
        unpermuted = torch.empty_like(q)
        unpermuted[desc_act_perm] = q
        result["qweight"] = pack_int32(unpermuted, 4, dim=0)
        g_idx = torch.empty(num_in, dtype=torch.int32)
        g_idx[desc_act_perm] = (torch.arange(num_in) // group_size).to(torch.int32)
        result["g_idx"] = g_idx
    return result
