"""PyTorch's INT4 matmul (tinygemm) as the decode path of INT4 projections: the conversion from our layout (codes,
and scales with zeros folded into tinygemm's (q − 8) · scale + zero) against our reference through the CPU twin
of the kernel (the CUDA one: scripts/gpu_tinygemm.py on the GPU machine), the dispatch, and the load-time
attachment to stacked and plain projections."""
import pytest
import torch
from torch import nn

from flashnext.models.decode_forms import attach_decode_forms
from flashnext.models.layers.int4_linear import Int4Linear
from flashnext.models.stacked import StackedProjection
from flashnext.ops import w4a16_tinygemm
from flashnext.ops.w4a16 import w4a16_linear, w4a16_linear_reference
from flashnext.weights.int4_layout import dequantize
from test_w4a16 import make_weight, rel_err


@pytest.mark.parametrize("kind,g", [("rtn", 128), ("sym", 64), ("asym", 128), ("asym", 32)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_tinygemm_equals_the_reference(kind, g, m):
    w, _ = make_weight(80, 256, g, kind, seed=m)
    assert w4a16_tinygemm.supports(w)
    codes = w4a16_tinygemm.codes(w)
    assert codes.shape == (80, 256) and 0 <= int(codes.min()) and int(codes.max()) <= 15
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
    got = w4a16_tinygemm.tinygemm_matmul(x, w4a16_tinygemm.to_tinygemm(w))
    want = w4a16_linear_reference(x, w)
    # bf16 products and bf16 zero offsets: ~5e-3 of the largest output (a wrong code or scale is ~1)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 80) and rel_err(got, want) < 2e-2


def test_unsupported_shapes_keep_our_kernels():
    act, _ = make_weight(80, 256, 128, "act")
    assert not w4a16_tinygemm.supports(act)                       # a column permutation
    assert not w4a16_tinygemm.supports(make_weight(72, 96, 32, "rtn")[0])   # K not a multiple of 128


def test_dispatch_takes_the_decode_form_for_few_bf16_rows():
    w, _ = make_weight(80, 256, 128, "rtn")
    form = w4a16_tinygemm.to_tinygemm(w)
    x = torch.randn(2, 256).bfloat16()
    assert torch.equal(w4a16_linear(x, w, form), w4a16_tinygemm.tinygemm_matmul(x, form))
    # fp32 activations and more rows than MAX_ROWS ignore it (the reference on CPU)
    x32 = torch.randn(2, 256)
    assert torch.equal(w4a16_linear(x32, w, form), w4a16_linear_reference(x32, w))
    many = torch.randn(w4a16_tinygemm.MAX_ROWS + 1, 256).bfloat16()
    assert torch.equal(w4a16_linear(many, w, form), w4a16_linear_reference(many, w))


def test_attach_gives_stacks_and_lone_projections_a_form(monkeypatch):
    model = nn.Module()
    model.a = Int4Linear(make_weight(64, 256, 128, "rtn", seed=1)[0])
    model.b = Int4Linear(make_weight(32, 256, 128, "rtn", seed=2)[0])
    model.lone = Int4Linear(make_weight(48, 256, 128, "rtn", seed=3)[0])
    model.project_qkv = StackedProjection(model.a, model.b)
    assert attach_decode_forms(model, torch.float32) == (0, 0)            # fp32 activations: nothing
    count, nbytes = attach_decode_forms(model, torch.bfloat16)
    assert count == 2 and nbytes > 0                                      # the stack and the lone projection
    assert model.project_qkv.decode_form is not None and model.lone.decode_form is not None
    assert model.a.decode_form is None and model.b.decode_form is None    # parts of a stack: never called
    x = torch.randn(1, 256).bfloat16()
    a, b = model.project_qkv(x)
    want = (x.float() @ dequantize(model.project_qkv.int4).t()).bfloat16()
    assert rel_err(torch.cat([a, b], dim=-1), want) < 2e-2
    monkeypatch.setenv("FLASHNEXT_W4A16_DECODE", "triton")
    fresh = nn.Module()
    fresh.lone = Int4Linear(make_weight(48, 256, 128, "rtn", seed=3)[0])
    assert attach_decode_forms(fresh, torch.bfloat16) == (0, 0)
