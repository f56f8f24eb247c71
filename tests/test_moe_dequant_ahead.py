"""ops/moe_dequant_ahead.py and its chain (models/layers/int4_experts.py: chain_dequant_ahead): a layer's MoE through
the chain's dequantised experts equals the dequant path's own result exactly and the reference to summation order;
the chain follows the layers' order; the scratch is dequantised again only for another layer's experts; the switch
and an expert cache leave the chain out. On the CPU there is no side stream (`start` does nothing): the stream
order itself is checked on the H200 (scripts/gpu_prefill.py --compare)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from flashnext.models.layers import int4_experts
from flashnext.models.layers.int4_experts import Int4Experts, chain_dequant_ahead
from flashnext.ops.int4_dequant_triton import dequantize_triton
from flashnext.ops.moe_dequant_ahead import DequantAhead
from flashnext.ops.moe_int4 import moe_int4_reference
from flashnext.ops.moe_int4_dequant import moe_int4_dequant
from oracle import rel_err
from test_moe_int4 import random_int4, routing


def layers(n=3, e=8, h=64, i=32):
    return torch.nn.ModuleList(Int4Experts(random_int4(e, 2 * i, h, 32, seed=10 * j),
                                           random_int4(e, h, i, 32, seed=10 * j + 1)) for j in range(n))


def test_the_chained_layers_equal_the_dequant_path_and_the_reference(monkeypatch):
    monkeypatch.setenv("FLASHNEXT_MOE_DEQUANT_AHEAD", "1")
    model = layers()
    assert chain_dequant_ahead(model) == 3
    ahead = model[0].dequant_ahead
    assert all(m.dequant_ahead is ahead for m in model)
    assert [ahead.following(m) for m in model] == [model[1], model[2], None]
    monkeypatch.setattr(int4_experts, "takes_dequant_path", lambda *a: True)   # the CPU's moe_int4 is the reference
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(5))
    ids, weights = routing(21, 8, 3)
    for m in model:
        gu, dn = m.weight_int4("gate_up"), m.weight_int4("down")
        got = m(x, weights, ids)
        assert ahead.holds is m
        assert torch.equal(got, moe_int4_dequant(x, ids, weights, gu, dn))
        assert rel_err(got, moe_int4_reference(x, ids, weights, gu, dn)) < 1e-5


def test_the_switch_leaves_the_chain_out(monkeypatch):
    model = layers(2)
    chain_dequant_ahead(model)
    monkeypatch.setattr(int4_experts, "takes_dequant_path", lambda *a: True)
    monkeypatch.delenv("FLASHNEXT_MOE_DEQUANT_AHEAD", raising=False)   # off by default
    x = torch.randn(7, 64)
    ids, weights = routing(7, 8, 2)
    model[0](x, weights, ids)
    assert model[0].dequant_ahead.holds is None and model[0].dequant_ahead.scratch is None


def test_the_scratch_is_dequantised_again_only_for_another_owner(monkeypatch):
    calls = []
    real = dequantize_triton

    def counting(w, dtype, out=None):
        calls.append(w)
        return real(w, dtype, out=out)

    from flashnext.ops import moe_dequant_ahead
    monkeypatch.setattr(moe_dequant_ahead, "dequantize_triton", counting)
    model = layers(2)
    ahead = DequantAhead(model)
    args = lambda m: (m.weight_int4("gate_up"), m.weight_int4("down"), torch.float32)  # noqa: E731
    first = ahead.take(model[0], *args(model[0]))
    again = ahead.take(model[0], *args(model[0]))
    assert len(calls) == 2 and again[0] is first[0]
    assert torch.equal(first[0], real(model[0].weight_int4("gate_up"), torch.float32))
    ahead.start(model[1], *args(model[1]))    # no side stream on the CPU: nothing queued
    assert len(calls) == 2 and ahead.holds is model[0]
    second = ahead.take(model[1], *args(model[1]))
    assert len(calls) == 4 and second[1] is first[1]   # the same scratch, now the next layer's
    assert torch.equal(second[1], real(model[1].weight_int4("down"), torch.float32))


def test_an_expert_cache_keeps_its_layers_out_of_the_chain():
    model = layers(3)
    model[1].expert_cache = object()
    assert chain_dequant_ahead(model) == 2
    assert model[1].dequant_ahead is None and model[0].dequant_ahead.following(model[0]) is model[2]
