import pytest
import torch

from flashnext.weights.fp8 import FP8_MAX, dequantize_block_fp8, quantize_block_fp8


def test_hand_built_example():
    # 2x3 weight, 1x2 blocks of (2, 2): block 0 covers columns 0-1, block 1 column 2 (ragged edge).
    weight = torch.tensor([[1.0, -2.0, 4.0], [0.5, 0.25, -8.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0, 0.5]])
    w = dequantize_block_fp8(weight, scale, block=(2, 2))
    assert torch.equal(w, torch.tensor([[2.0, -4.0, 2.0], [1.0, 0.5, -4.0]]))


@pytest.mark.parametrize("shape", [(128, 128), (130, 260), (7, 300), (256, 64), (3, 200, 129)])
def test_roundtrip(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.02
    q, scale = quantize_block_fp8(w)
    n, k = shape[-2:]
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (*shape[:-2], -(-n // 128), -(-k // 128))
    deq = dequantize_block_fp8(q, scale)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4, and each block's largest value maps to 448.
    assert ((deq - w).abs() <= w.abs() * 2**-4 + scale.max() * 2**-9).all()
    assert q.float().abs().amax() == FP8_MAX
    # Re-quantising the dequantised weight is exact.
    q2, scale2 = quantize_block_fp8(deq)
    assert torch.equal(scale2, scale) and torch.equal(q2.float(), q.float())


def test_per_tensor_scale_and_zero_block():
    w = torch.zeros(4, 130)
    w[:, 129] = 3.0
    q, scale = quantize_block_fp8(w)
    assert torch.equal(scale[0, 0], torch.tensor(1.0))  # an all-zero block keeps scale 1, not 0/448
    assert torch.equal(dequantize_block_fp8(q, scale), w)
    assert torch.equal(dequantize_block_fp8(torch.ones(5, 3).to(torch.float8_e4m3fn), torch.tensor([0.25])),
                       torch.full((5, 3), 0.25))


def test_scale_shape_mismatch_is_explained():
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_block_fp8(torch.zeros(256, 256).to(torch.float8_e4m3fn), torch.ones(1, 2))
