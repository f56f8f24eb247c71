"""Triton causal depthwise conv for one sequence (reference: ops/causal_conv1d.py): programs over (row tiles,
channel tiles); tap j of output row t reads input row t + j·dilation − span, from the carried tail when that is
negative. fp32 sums, rounded to the weight's dtype as the conv's output is, silu, x's dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def _causal_conv1d_kernel(x_ptr, tail_ptr, w_ptr, out_ptr, T, C, span, dilation, stride_x, stride_tail,
                          K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = offs_t < T
    c_ok = offs_c < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
    for j in tl.static_range(K):
        src = offs_t + j * dilation - span                 # input row; < 0: row span + src of the tail
        in_x = t_ok & (src >= 0)
        in_tail = t_ok & (src < 0)
        v = tl.load(x_ptr + src[:, None] * stride_x + offs_c[None, :], mask=in_x[:, None] & c_ok[None, :], other=0.0)
        v_tail = tl.load(tail_ptr + (span + src)[:, None] * stride_tail + offs_c[None, :],
                         mask=in_tail[:, None] & c_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_c * K + j, mask=c_ok, other=0.0).to(tl.float32)
        # inputs rounded to the weight's dtype first, as the reference feeds the conv
        v = v.to(w_ptr.dtype.element_ty).to(tl.float32)
        v_tail = v_tail.to(x_ptr.dtype.element_ty).to(w_ptr.dtype.element_ty).to(tl.float32)
        acc += w[None, :] * tl.where(in_x[:, None], v, v_tail)
    conv = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    out = conv * tl.sigmoid(conv)
    tl.store(out_ptr + offs_t[:, None] * C + offs_c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])


def causal_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor, dilation: int = 1):
    """x [T, C], weight [C, K], tail [span, C] → (out [T, C] in x's dtype, new tail [span, C] in x's dtype)."""
    length, channels = x.shape
    span, kernel = tail.shape[0], weight.shape[1]
    assert span == (kernel - 1) * dilation > 0 and tail.shape[1] == channels and weight.shape[0] == channels
    x = x if x.stride(-1) == 1 else x.contiguous()
    tail = tail if tail.stride(-1) == 1 else tail.contiguous()
    weight = weight.contiguous()
    out = torch.empty(length, channels, dtype=x.dtype, device=x.device)
    if length:
        block_t, block_c = (32, 128) if x.is_cuda else (8, 16)
        _causal_conv1d_kernel[(triton.cdiv(length, block_t), triton.cdiv(channels, block_c))](
            x, tail, weight, out, length, channels, span, dilation, x.stride(0), tail.stride(0),
            K=kernel, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    new_tail = torch.cat([tail.to(x.dtype), x[-span:]], dim=0)[-span:]
    return out, new_tail
