"""Zero-centred RMSNorm: the op's reference is the module's math, and the Triton kernel (TRITON_INTERPRET=1 on
CPU) equals it, per row and per group, with strided rows, one row or several a program (a partial last one)."""
import importlib.util

import pytest
import torch

from flashnext.ops.rms_norm import rms_norm_reference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("shape,group", [((3, 64), None), ((2, 5, 48), None), ((4, 4 * 40), 40), ((1, 2048), None),
                                         ((0, 32), None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows_per_prog", [None, 4])
def test_kernel_equals_reference(shape, group, dtype, rows_per_prog):
    from flashnext.ops.rms_norm_triton import rms_norm_triton

    g = torch.Generator().manual_seed(sum(shape))
    wide = torch.randn(*shape[:-1], shape[-1] + 8, generator=g).to(dtype)
    x = wide[..., : shape[-1]]                                   # rows not contiguous with each other
    weight = (torch.randn(shape[-1], generator=g) * 0.2).to(dtype)
    got = rms_norm_triton(x, weight, 1e-6, group, rows_per_prog)
    want = rms_norm_reference(x, weight, 1e-6, group)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-5)


@pytest.mark.parametrize("shape", [(7, 3, 48), (33, 128)])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows_per_prog", [None, 8])
def test_gated_kernel_equals_reference(shape, activation, dtype, rows_per_prog):
    """GatedDeltaNet's output norm (prefill: T × heads rows): the kernel rounds where the reference rounds."""
    from flashnext.ops.rms_norm import gated_rms_norm_reference
    from flashnext.ops.rms_norm_triton import gated_rms_norm_triton

    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    gate = torch.randn(*shape, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    got = gated_rms_norm_triton(x, gate, w, 1e-6, activation, rows_per_prog)
    want = gated_rms_norm_reference(x, gate, w, 1e-6, activation)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=1e-5)


def test_rows_per_program():
    """One row a program while rows are few (decode), more as they grow, never over MAX_TILE elements."""
    from flashnext.ops import rms_norm_triton as k

    cpu = torch.device("cpu")   # 8 SMs assumed off the GPU
    assert k.rows_per_program(12, 128, cpu) == 1
    assert k.rows_per_program(16 * 4, 128, cpu) == 4
    assert k.rows_per_program(16 * 5, 128, cpu) == 4        # a power of two, rounded down
    assert k.rows_per_program(262144, 128, cpu) == k.MAX_TILE // 128
    assert k.rows_per_program(262144, 4096, cpu) == 1
