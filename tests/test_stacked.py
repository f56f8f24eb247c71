"""Stacked projections (models/stacked.py) change no result: a model with them equals the same model without,
whole-sequence and in the fixed-shape decode step, bf16-style views and INT4 concatenations alike."""
import copy

import pytest
import torch

from flashnext.models.layers.int4_experts import quantize_experts_int4
from flashnext.models.quantize import quantize_dense_int4
from flashnext.models.session import Session
from flashnext.models.stacked import StackedProjection, stack_projections, unstack_projections
from oracle import hf_model, ours_from_hf, rel_err


@pytest.mark.parametrize("arch", ["qwen4_exp", "qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("int4", [False, True])
def test_stacked_model_equals_unstacked(arch, int4):
    hf, raw = hf_model(arch, seed=3)
    plain = ours_from_hf(hf, raw)
    if int4:
        quantize_dense_int4(plain)
        quantize_experts_int4(plain)
    stacked = copy.deepcopy(plain)
    assert stack_projections(stacked) > 0
    kinds = {name for m in stacked.modules() for name in ("project_qkv", "project_qkvz")
             if isinstance(getattr(m, name, None), StackedProjection)}
    assert "project_qkv" in kinds and ("project_qkvz" in kinds) == (arch != "qwen3_next")   # split GDN layouts
    ids = torch.randint(2, 500, (40,), generator=torch.Generator().manual_seed(0))
    want = Session(plain, 64).extend(ids, all_logits=True)
    got_session = Session(stacked, 64)
    got = got_session.extend(ids, all_logits=True)
    assert rel_err(got, want) < 1e-6
    # the checkpoint view is unchanged: same keys, same values
    assert plain.state_dict().keys() == stacked.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.equal(stacked.state_dict()[key], value), key


def test_views_share_storage_and_mixed_kinds_refuse():
    lin = [torch.nn.Linear(8, n, bias=False) for n in (3, 5)]
    s = StackedProjection(*lin)
    assert lin[0].weight.data_ptr() == s.weight.data_ptr()           # a view, no copy
    x = torch.randn(2, 8)
    y = s(x)
    assert [t.shape[-1] for t in y] == [3, 5]
    assert s.padding == 0 and s.weight.shape[0] == 8
    for part, out in zip(lin, y):
        torch.testing.assert_close(out, part(x))
    # 3 + 6 rows: padded with zero rows to ROW_ALIGN (an aligned width for cuBLAS), the padding's outputs dropped
    odd = [torch.nn.Linear(8, n, bias=False) for n in (3, 6)]
    want = [m(x) for m in odd]
    s = StackedProjection(*odd)
    assert s.padding == 7 and s.weight.shape[0] == 16 and not s.weight[9:].any()
    got = s(x)
    assert len(got) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError):
        StackedProjection(torch.nn.Linear(8, 3, bias=True), lin[1])


def test_int4_parts_become_column_views_of_the_stack():
    from flashnext.models.layers.int4_linear import Int4Linear
    from flashnext.ops.w4a16 import w4a16_linear_reference
    from flashnext.weights.int4_layout import quantize_rtn

    parts = [Int4Linear(quantize_rtn(torch.randn(n, 256, generator=torch.Generator().manual_seed(n)), 128))
             for n in (32, 48)]
    alone = [p.weight_int4 for p in parts]
    x = torch.randn(3, 256)
    want = [w4a16_linear_reference(x, w) for w in alone]
    s = StackedProjection(*parts)
    assert parts[0].qweight.data_ptr() == s.int4.qweight.data_ptr()          # no copy left behind
    assert parts[1].scales.data_ptr() == s.int4.scales[:, 32:].data_ptr()
    for part, w, y in zip(parts, alone, want):
        assert torch.equal(part.qweight, w.qweight) and torch.equal(part.scales, w.scales)
        assert torch.equal(part(x), y)                                        # still callable, same result
    assert all(torch.equal(a, b) for a, b in zip(s(x), want))
    owner = torch.nn.Module()
    owner.gate_up = s
    unstack_projections(owner)                           # quantising again: the parts are weights of their own
    assert owner.gate_up is None and all(p.qweight.is_contiguous() and p.scales.is_contiguous() for p in parts)
    assert all(torch.equal(p(x), y) for p, y in zip(parts, want))


def test_quantising_after_stacking_drops_the_stale_stack():
    hf, raw = hf_model("qwen3_next", seed=4)
    model = ours_from_hf(hf, raw)
    stack_projections(model)
    quantize_dense_int4(model)          # replaces gate_proj/up_proj: the bf16 stack must not survive it
    assert all(getattr(m, "gate_up", None) is None for m in model.modules())
    fresh = ours_from_hf(hf, raw)
    quantize_dense_int4(fresh)
    ids = torch.randint(2, 500, (20,), generator=torch.Generator().manual_seed(1))
    assert rel_err(Session(model, 32).extend(ids, all_logits=True), Session(fresh, 32).extend(ids, all_logits=True)) < 1e-6
