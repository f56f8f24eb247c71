"""The one-row INT4 GEMV (ops/w4a16_row_triton.py; CPU: TRITON_INTERPRET=1) against w4a16_linear_reference at odd
sizes: symmetric and asymmetric weights, groups of 32–128, one group a program, several (the pipelined loop) and the
whole K, bf16 and fp32 activations; and which projections the dispatch (ops/w4a16.py) sends there."""
import pytest
import torch

from flashnext.ops.w4a16 import w4a16_linear_reference
from test_w4a16 import make_weight, needs_triton, rel_err

pytestmark = needs_triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k,g,kind", [(40, 128, 128, "rtn"), (104, 384, 128, "asym"), (520, 256, 64, "sym"),
                                        (64, 96, 32, "asym"), (1032, 640, 128, "rtn")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_gemv_matches_reference(n, k, g, kind, dtype):
    from flashnext.ops.arrival import buffers
    from flashnext.ops.w4a16_row_triton import RowConfig, row_config, supports, w4a16_row

    w, _ = make_weight(n, k, g, kind, seed=n + k)
    w = w.to(DEVICE)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(DEVICE, dtype)
    assert supports(x, w)
    want = w4a16_linear_reference(x.float(), w)
    bound = 1e-5 if dtype == torch.float32 else 8e-3   # bf16: the output's rounding
    for cfg in (row_config(n, k, g, x.device), RowConfig(128, 1, 1), RowConfig(128, 2, 1, num_stages=3),
                RowConfig(512, 16, 4)):
        got = w4a16_row(x, w, cfg)
        assert got.shape == (1, n) and got.dtype == dtype
        assert rel_err(got, want) < bound, cfg
        assert torch.equal(got, w4a16_row(x, w, cfg))   # split partials are added in a fixed order
    assert all(not c.any() for c in buffers(x.device))   # the last program of each column block reset its counter


def test_row_gemv_refuses_what_it_does_not_compute():
    from flashnext.ops.w4a16_row_triton import supports

    w, _ = make_weight(64, 256, 128, "act")
    assert not supports(torch.randn(1, 256), w)                        # act-order: w4a16_triton's
    w, _ = make_weight(64, 512, 256, "rtn")
    assert not supports(torch.randn(1, 512), w)                        # 32 words a group: not in registers
    w, _ = make_weight(64, 256, 128, "rtn")
    assert not supports(torch.randn(2, 256), w)                        # two rows: tinygemm's


def test_only_wide_projections_take_the_row_kernel(monkeypatch):
    from flashnext.ops import w4a16_row_triton

    wide, _ = make_weight(w4a16_row_triton.ROW_MIN_N, 128, 128, "rtn")
    narrow, _ = make_weight(w4a16_row_triton.ROW_MIN_N - 8, 128, 128, "rtn")
    assert w4a16_row_triton.faster(wide) and not w4a16_row_triton.faster(narrow)
    monkeypatch.setenv("FLASHNEXT_W4A16_ROW_MIN_N", "0")   # what the GPU check of a tiny model sets
    assert w4a16_row_triton.faster(narrow)
