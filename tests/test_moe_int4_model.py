"""Routed experts held in INT4 (quantize_experts_int4): a tiny model with quantised experts equals the same
model with the experts' weights replaced by their dequantised values, whole and token by token (fp32)."""
import random

import pytest
import torch

from flashnext.engine.loading import load_model
from flashnext.models.layers.int4_experts import Int4Experts, quantize_experts_int4, quantize_stacked
from flashnext.models.layers.moe import Experts
from flashnext.models.session import Session
from flashnext.weights.int4_layout import dequantize, quantize_rtn
from oracle import rel_err

TOL = 1e-5


def _prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 480) for _ in range(n)]


@pytest.fixture(scope="module", params=["tiny-flash-next", "tiny-qwen3-next"])
def pair(request):
    model = load_model(request.param, "cpu", torch.float32).model
    twin = load_model(request.param, "cpu", torch.float32).model
    replaced = quantize_experts_int4(model)
    for name in replaced:
        int4, experts = model.get_submodule(name), twin.get_submodule(name)
        experts.gate_up_proj.data = dequantize(int4.weight_int4("gate_up"))
        experts.down_proj.data = dequantize(int4.weight_int4("down"))
    return model, twin, replaced


def test_every_experts_module_is_int4(pair):
    model, _, replaced = pair
    assert replaced and not any(isinstance(m, Experts) for m in model.modules())
    assert sum(isinstance(m, Int4Experts) for m in model.modules()) == len(replaced) == model.cfg.num_layers


def test_whole_sequence_equals_dequantised_experts(pair):
    model, twin, _ = pair
    ids = _prompt(80)  # > 64: the chunked GDN path; > indexer budget + 3: QSA selection runs
    got = Session(model, 128).extend(ids, all_logits=True)
    assert rel_err(got, Session(twin, 128).extend(ids, all_logits=True)) < TOL


def test_token_by_token_equals_dequantised_experts(pair):
    model, twin, _ = pair
    ours, ref = Session(model, 64), Session(twin, 64)
    for t in _prompt(12, seed=1):
        assert rel_err(ours.extend([t]), ref.extend([t])) < TOL


def test_stacked_quantisation_is_per_expert_rtn():
    w = torch.randn(5, 24, 64)
    stacked = quantize_stacked(w, 32)
    for e in range(5):
        one = quantize_rtn(w[e], 32)
        assert torch.equal(stacked.qweight[e], one.qweight) and torch.equal(stacked.scales[e], one.scales)
