import pytest
import torch

from flashnext.weights.int4 import dequantize_gptq, pack_int32, quantize_gptq_rtn, unpack_int32


def auto_gptq_dequant(qweight, qzeros, scales, g_idx, bits=4):
    """auto_gptq's v1 dequantisation (qlinear_cuda_old), written out independently as a reference."""
    wf = torch.arange(0, 32, bits, dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 32 // bits), wf.unsqueeze(0))
    zeros = (torch.bitwise_and(zeros, 2**bits - 1) + 1).reshape(scales.shape)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1))
    weight = torch.bitwise_and(weight, 2**bits - 1).reshape(-1, qweight.shape[1])
    return (scales.float()[g_idx] * (weight - zeros[g_idx]).float()).t()


def test_hand_built_example():
    # K = 8 inputs, N = 8 outputs, one group. Column 0 holds q = 0..7 down the inputs, so its word is
    # 0x76543210 (input j in nibble j); column 1 holds q = 15 everywhere (0xFFFFFFFF = -1 as int32).
    q = torch.zeros(8, 8, dtype=torch.int64)
    q[:, 0] = torch.arange(8)
    q[:, 1] = 15
    qweight = pack_int32(q, 4, dim=0)
    assert qweight.shape == (1, 8) and qweight.dtype == torch.int32
    assert qweight[0, 0].item() == 0x76543210
    assert qweight[0, 1].item() == -1
    # Symmetric: every stored zero is 7 -> 0x77777777; real zero 8.
    qzeros = torch.tensor([[0x77777777]], dtype=torch.int32)
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    w = dequantize_gptq(qweight, qzeros, scales)
    assert w.shape == (8, 8)  # [N, K]
    assert torch.equal(w[0], 0.5 * (torch.arange(8.0) - 8))
    assert torch.equal(w[1], torch.full((8,), 0.5 * 7))
    # Asymmetric zeros: output n has stored zero n (real zero n + 1), nibble n of the single qzeros word.
    qzeros = torch.tensor([[0x76543210]], dtype=torch.int32)
    w = dequantize_gptq(qweight, qzeros, scales)
    assert torch.equal(w[0], 0.5 * (torch.arange(8.0) - 1))
    assert torch.equal(w[1], torch.full((8,), 0.5 * (15 - 2)))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    values = torch.randint(0, 2**bits, (64, 32))
    assert torch.equal(unpack_int32(pack_int32(values, bits, dim=0), bits, dim=0), values)
    assert torch.equal(unpack_int32(pack_int32(values, bits, dim=1), bits, dim=1), values)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("shape,group", [((24, 64), 32), ((40, 256), 128), ((8, 96), 32)])
def test_rtn_roundtrip_and_reference(shape, group, sym):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.1 + (0.0 if sym else 0.03)
    packed = quantize_gptq_rtn(w, group_size=group, sym=sym)
    n, k = shape
    assert packed["qweight"].shape == (k // 8, n) and packed["qweight"].dtype == torch.int32
    assert packed["qzeros"].shape == (k // group, n // 8) and packed["qzeros"].dtype == torch.int32
    assert packed["scales"].shape == (k // group, n) and packed["scales"].dtype == torch.float16
    deq = dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"])
    g_idx = torch.arange(k) // group
    assert torch.equal(deq, auto_gptq_dequant(packed["qweight"], packed["qzeros"], packed["scales"], g_idx))
    # Error at most half a step (plus fp16 rounding of the scale).
    step = packed["scales"].float()[g_idx].t()
    assert ((deq - w).abs() <= step * 0.5 + 1e-6 + w.abs() * 1e-3).all()
    if sym:
        assert (unpack_int32(packed["qzeros"], 4, dim=1) == 7).all()
    # Quantising the dequantised weight reproduces the same tensors exactly.
    again = quantize_gptq_rtn(deq, group_size=group, sym=sym)
    for name in packed:
        assert torch.equal(again[name], packed[name]), name


def test_desc_act_non_monotone_g_idx():
    torch.manual_seed(1)
    w = torch.randn(16, 64)
    perm = torch.randperm(64)
    packed = quantize_gptq_rtn(w, group_size=16, desc_act_perm=perm)
    g_idx = packed["g_idx"]
    assert g_idx.dtype == torch.int32 and g_idx.shape == (64,)
    assert not bool((g_idx[1:] >= g_idx[:-1]).all())
    deq = dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"], g_idx)
    assert torch.equal(deq, auto_gptq_dequant(packed["qweight"], packed["qzeros"], packed["scales"], g_idx.long()))
    # Ignoring g_idx would pair inputs with the wrong scales.
    assert not torch.equal(deq, dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"]))
    step = packed["scales"].float()[g_idx.long()].t()
    assert ((deq - w).abs() <= step * 0.5 + 1e-3 * w.abs() + 1e-6).all()


def test_gptq_v2_zeros():
    q = torch.full((8, 8), 9)
    qweight = pack_int32(q, 4, dim=0)
    qzeros = pack_int32(torch.full((1, 8), 8), 4, dim=1)
    scales = torch.ones(1, 8, dtype=torch.float16)
    assert (dequantize_gptq(qweight, qzeros, scales, zeros_minus_one=False) == 1).all()
    assert (dequantize_gptq(qweight, qzeros, scales) == 0).all()


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="cannot quantise"):
        quantize_gptq_rtn(torch.randn(8, 100), group_size=32)


@pytest.mark.parametrize("sym", [True, False])
def test_kernel_layout_rtn_stays_on_the_weights_device(sym):
    """int4_layout.quantize_rtn makes every tensor on the weight's device (`--quantize int4` quantises on the GPU); the
    meta device stands in for it, as a CPU-made zero point fails there the same way."""
    from flashnext.weights.int4_layout import quantize_rtn

    packed = quantize_rtn(torch.randn(16, 128, device="meta"), 32, sym=sym)
    assert all(t.device.type == "meta" for t in packed.tensors().values())
