"""Random-weight models built in memory (weights/synth_device.py) and the `mem:` model names of load_model."""
import math

import pytest
import torch

from flashnext.engine.loading import load_model
from flashnext.models.layers.int4_experts import Int4Experts
from flashnext.models.layers.int4_linear import Int4Linear
from flashnext.models.layers.moe import Router
from flashnext.models.layers.row_table import RowTable
from flashnext.models.quantize import dense_int4_targets, group_size_for
from flashnext.models.session import Session
from flashnext.weights.config import parse_config
from flashnext.weights.int4_layout import dequantize
from flashnext.weights.presets import get_preset
from flashnext.weights.synth_device import build_synthetic_model, synthetic_tokenizer_dir

PRESETS = ["tiny-flash-next", "tiny-qwen3-next"]


def cfg_of(preset):
    return parse_config(get_preset(preset))


def prompt(cfg, n=200, seed=0):
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def routed_ids(model, ids):
    """Expert ids each Router picked while `ids` ran through a Session: {router name: [N, k]}."""
    picked, hooks = {}, []

    def keep(name):
        def hook(module, args, out):
            picked[name] = out[1]
        return hook

    for name, module in model.named_modules():
        if isinstance(module, Router):
            hooks.append(module.register_forward_hook(keep(name)))
    try:
        logits = Session(model, len(ids) + 8).extend(ids, all_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    return logits, picked


@pytest.fixture(scope="module", params=PRESETS)
def built(request):
    cfg = cfg_of(request.param)
    return cfg, build_synthetic_model(cfg, "cpu", torch.float32, seed=0, int4=True, ple_placement="host")


def test_forward_is_finite_and_routing_covers_the_experts(built):
    cfg, model = built
    logits, picked = routed_ids(model, prompt(cfg))
    assert logits.shape == (200, cfg.vocab_size) and bool(logits.isfinite().all())
    assert logits.std() > 0.1  # not collapsed
    assert len(picked) == cfg.num_layers
    for name, ids in picked.items():
        counts = torch.bincount(ids.flatten(), minlength=cfg.num_experts)
        # zero-mean weights spread tokens over the experts; a biased synthesis sends them to a few
        assert (counts > 0).sum() >= 0.9 * cfg.num_experts, (name, counts)
        assert counts.max() < 0.5 * ids.numel(), (name, counts)


def test_int4_modules_where_quantize_puts_them(built):
    cfg, model = built
    experts = [m for m in model.modules() if isinstance(m, Int4Experts)]
    assert len(experts) == cfg.num_layers
    int4_linear = {n for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    targets = dense_int4_targets(model) + sorted(int4_linear)  # an Int4Linear is no longer an nn.Linear target
    for name in targets:
        module = model.get_submodule(name)
        fits = group_size_for(module.in_features, 128) is not None and module.out_features % 8 == 0
        assert isinstance(module, Int4Linear) == fits, name
    assert int4_linear


def test_dequantised_weights_have_the_synthetic_std_and_zero_mean(built):
    _, model = built
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, Int4Experts)]
    weights = [(f"{n}.{part}", m.weight_int4(part)) for n, m in experts for part in ("gate_up", "down")]
    weights += [(n, m.weight_int4) for n, m in model.named_modules() if isinstance(m, Int4Linear)]
    for name, w in weights:
        values = dequantize(w)
        target = 1 / math.sqrt(w.in_features)  # synth._init: std 1/sqrt(fan-in)
        assert abs(values.std().item() / target - 1) < 0.3, (name, values.std().item(), target)
        # scales of random sign make the mean zero; what is left fluctuates per group (one sign per scale)
        assert abs(values.mean().item()) < 4 * target / math.sqrt(w.scales.numel()), name
        negative = (w.scales < 0).float().mean().item()
        assert 0.3 < negative < 0.7, (name, negative)


def test_ple_table_placement_and_fp8():
    cfg = cfg_of("tiny-flash-next")
    ids = prompt(cfg, 40)
    logits = {}
    for placement, ple_dtype in (("device", None), ("host", None), ("host", torch.float8_e4m3fn)):
        model = build_synthetic_model(cfg, "cpu", torch.float32, ple_placement=placement, ple_dtype=ple_dtype)
        table = next(m for m in model.modules() if isinstance(m, RowTable))
        assert table.placement == placement and table.weight.dtype == (ple_dtype or torch.float32)
        assert (table.scale is not None) == (ple_dtype is not None)
        logits[placement, ple_dtype] = Session(model, 64).extend(ids, all_logits=True)
    assert torch.equal(logits["device", None], logits["host", None])
    fp8 = logits["host", torch.float8_e4m3fn]
    assert bool(fp8.isfinite().all()) and not torch.equal(fp8, logits["host", None])


def test_same_seed_same_model_without_int4():
    cfg = cfg_of("tiny-qwen3-next")
    a, b = (build_synthetic_model(cfg, "cpu", torch.float32, seed=3, int4=False) for _ in range(2))
    assert not any(isinstance(m, (Int4Linear, Int4Experts)) for m in a.modules())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert bool(Session(a, 32).extend(prompt(cfg, 20)).isfinite().all())


def test_16_bit_experts_of_a_full_size_model_are_refused():
    with pytest.raises(ValueError, match="--quantize int4"):
        build_synthetic_model(cfg_of("flash-next"), "cpu", torch.bfloat16, int4=False)


def test_tokenizer_dir_holds_no_weights(tmp_path):
    out = synthetic_tokenizer_dir("tiny-flash-next", tmp_path)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= names
    assert not any(n.endswith(".safetensors") for n in names)
    assert synthetic_tokenizer_dir("tiny-flash-next", tmp_path) == out  # written once


def test_mem_model_through_load_model(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHNEXT_CACHE", str(tmp_path))
    loaded = load_model("mem:tiny-flash-next", "cpu", torch.float32, quantize="int4")
    assert any(isinstance(m, Int4Experts) for m in loaded.model.modules())
    assert (loaded.path / "config.json").exists() and loaded.config.arch == "qwen4_exp"
    assert loaded.tokenizer.encode("hello world") and loaded.weight_bytes > 0
    out = Session(loaded.model, 64).greedy(loaded.tokenizer.encode("hello world"), 4)
    assert len(out) == 4
    with pytest.raises(ValueError, match="unknown preset"):
        load_model("mem:no-such-model", "cpu", torch.float32)
    with pytest.raises(ValueError, match="placement"):
        load_model("mem:tiny-flash-next", "cpu", torch.float32, ple_placement="gpu")


def test_checkpoint_ple_placement_host_gives_the_same_logits(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHNEXT_CACHE", str(tmp_path))
    ids = prompt(cfg_of("tiny-flash-next"), 30)
    logits = {}
    for placement in ("device", "host"):
        model = load_model("tiny-flash-next", "cpu", torch.float32, ple_placement=placement).model
        assert next(m for m in model.modules() if isinstance(m, RowTable)).placement == placement
        logits[placement] = Session(model, 64).extend(ids, all_logits=True)
    assert torch.equal(logits["device"], logits["host"])
