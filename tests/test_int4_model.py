"""Dense projections held in INT4 (quantize_dense_int4, `--quantize int4`): a quantised tiny model equals the same
model with those weights replaced by their dequantised values, whole sequence, token by token and through
the engine's greedy generation; the choice of quantised projections is the documented one (docs/int4.md)."""
import copy
import random

import pytest
import torch

from flashnext.engine.llm import LLM
from flashnext.engine.loading import load_model
from flashnext.engine.sampling_params import SamplingParams
from flashnext.models.layers.int4_linear import Int4Linear
from flashnext.models.quantize import dense_int4_targets, quantize_dense_int4
from flashnext.models.session import Session
from flashnext.weights.checkpoint import load_checkpoint
from flashnext.weights.int4_layout import Int4Weight, dequantize
from flashnext.weights.synth import synthesize

PRESETS = ["tiny-flash-next", "tiny-qwen3-next"]
TOL = 1e-5
QUANTISED = {"in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
             "gate_proj", "up_proj", "down_proj"}


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def dequantised_twin(quantised):
    """A copy of `quantised` whose Int4Linear modules are nn.Linear holding the dequantised weights: the
    reference path."""
    twin = copy.deepcopy(quantised)
    for name, module in quantised.named_modules():
        if isinstance(module, Int4Linear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight.data = dequantize(module.weight_int4)
            if module.bias is not None:
                linear.bias.data = module.bias.clone()
            parent, _, child = name.rpartition(".")
            setattr(twin.get_submodule(parent), child, linear.requires_grad_(False))
    return twin


@pytest.fixture(scope="module", params=PRESETS)
def pair(request):
    model = load_model(request.param, "cpu", torch.float32).model
    original = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    replaced = quantize_dense_int4(model)
    return request.param, model, dequantised_twin(model), replaced, original


def _prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 480) for _ in range(n)]


def test_the_documented_projections_are_int4(pair):
    _, model, _, replaced, original = pair
    assert replaced and all(name.split(".")[-1] in QUANTISED for name in replaced)
    kept = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert "lm_head" in kept and not any(n.split(".")[-1] in QUANTISED for n in kept)
    assert set(replaced) | set(kept) == set(original)
    assert any(n.endswith("shared_expert_gate") for n in kept)
    assert any(n.endswith(("in_proj_b", "in_proj_ba")) for n in kept)
    # Every layer's mixer and MLP projections are quantised (tiny K uses a smaller group, never skips).
    per_layer = {n.split(".")[2] for n in replaced}
    assert per_layer == {str(i) for i in range(model.cfg.num_layers)}


def test_whole_sequence_equals_dequantised_reference(pair):
    _, model, twin, _, _ = pair
    ids = _prompt(80)  # > 64: the chunked GDN path; > indexer budget + 3: QSA selection runs
    got = Session(model, 128).extend(ids, all_logits=True)
    want = Session(twin, 128).extend(ids, all_logits=True)
    assert rel_err(got, want) < TOL


def test_token_by_token_equals_dequantised_reference(pair):
    _, model, twin, _, _ = pair
    ids = _prompt(24, seed=1)
    ours, ref = Session(model, 64), Session(twin, 64)
    for t in ids:
        assert rel_err(ours.extend([t]), ref.extend([t])) < TOL


def test_quantisation_stays_close_to_the_original(pair):
    name, model, _, _, _ = pair
    original = load_model(name, "cpu", torch.float32).model
    ids = _prompt(16, seed=2)
    got = Session(model, 32).extend(ids, all_logits=True)
    want = Session(original, 32).extend(ids, all_logits=True)
    # RTN int4 of random tiny weights (groups of 32-64) moves logits by ~20% on average, compounded over the
    # layers; unrelated logits would be off by >100%. This only catches a wrong packing, not quality.
    mean_rel = ((got - want).abs().mean() / want.abs().mean()).item()
    assert 0 < mean_rel < 0.5


@pytest.mark.parametrize("preset", PRESETS)
def test_engine_quantize_int4_greedy_equals_reference(preset):
    llm = LLM(preset, device="cpu", dtype="float32", quantize="int4", max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=256)
    modules = list(llm.engine.loaded.model.modules())
    assert any(isinstance(m, Int4Linear) for m in modules)
    assert any(type(m).__name__ == "Int4Experts" for m in modules)  # the routed experts too (int4_experts.py)
    assert not any(type(m).__name__ == "Experts" for m in modules)
    # The twin keeps the engine's Int4Experts (their exactness is tests/test_moe_int4*.py's); only the dense
    # projections are swapped for their dequantised nn.Linear.
    twin = dequantised_twin(llm.engine.loaded.model)
    prompts = [_prompt(n, seed=n) for n in (5, 70, 19)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        s = Session(twin, 128)
        logits, want = s.extend(prompt), []
        for _ in range(8):
            want.append(int(logits.argmax()))
            logits = s.extend([want[-1]])
        assert out.token_ids == want


def test_engine_refuses_unknown_quantization():
    with pytest.raises(ValueError, match="int4"):
        load_model("tiny-qwen3-next", "cpu", torch.float32, quantize="int8")


# AutoRound (auto_gptq packing, fp16 scales) and compressed-tensors pack-quantized (the model's dtype, bf16, in scales)
SCALES = {"int4": torch.float16, "int4-ct": torch.bfloat16}


@pytest.mark.parametrize("kind", sorted(SCALES))
@pytest.mark.parametrize("preset", PRESETS)
def test_int4_checkpoint_keeps_dense_projections_packed(preset, kind, tmp_path):
    folder = synthesize(preset, tmp_path / "ckpt", dtype=kind, seed=3)
    loaded = load_model(str(folder), "cpu", torch.float32)
    model = loaded.model
    packed = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert set(packed) == set(dense_int4_targets(load_model(preset, "cpu", torch.float32).model))
    assert all(m.scales.dtype == SCALES[kind] for m in packed.values())  # the checkpoint's scales, unrounded
    # The packed weights dequantise exactly to what loading used to produce (dequantise at load).
    meta = {k: (tuple(v.shape), v.dtype) for k, v in load_model(preset, "cpu", torch.float32).model.state_dict().items()}
    dense = load_checkpoint(folder, meta, dtype=torch.float32, progress=False)
    for name, module in packed.items():
        assert torch.equal(dequantize(module.weight_int4), dense[f"{name}.weight"]), name
    twin = dequantised_twin(model)
    ids = _prompt(70, seed=4)
    assert rel_err(Session(model, 96).extend(ids, all_logits=True), Session(twin, 96).extend(ids, all_logits=True)) < TOL
    assert loaded.weight_bytes < sum(t.numel() * t.element_size() for t in dense.values())


@pytest.mark.parametrize("kind", sorted(SCALES))
@pytest.mark.parametrize("preset", PRESETS)
def test_int4_checkpoint_keeps_experts_packed(preset, kind, tmp_path):
    """Routed experts of an INT4 checkpoint load as stacked Int4Experts (never a 16-bit copy), dequantise exactly
    to what loading them dense gives, and the model computes what a twin with those dense experts computes."""
    from flashnext.models.layers.int4_experts import Int4Experts
    from flashnext.models.layers.moe import Experts

    folder = synthesize(preset, tmp_path / "ckpt", dtype=kind, seed=5)
    model = load_model(str(folder), "cpu", torch.float32).model
    experts = {n: m for n, m in model.named_modules() if isinstance(m, Int4Experts)}
    assert experts and not any(isinstance(m, Experts) for m in model.modules())
    reference = load_model(preset, "cpu", torch.float32).model
    meta = {k: (tuple(v.shape), v.dtype) for k, v in reference.state_dict().items()}
    dense = load_checkpoint(folder, meta, dtype=torch.float32, progress=False)
    twin = copy.deepcopy(model)
    for name, module in experts.items():
        for prefix, key in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            w = module.weight_int4(prefix)
            assert w.scales.dtype == SCALES[kind]                        # the checkpoint's scales, unrounded
            assert torch.equal(torch.stack([dequantize(Int4Weight(w.qweight[e], w.scales[e], None if w.zeros is None
                                                                  else w.zeros[e], None, w.group_size))
                                            for e in range(w.qweight.shape[0])]), dense[f"{name}.{key}"]), name
        plain = Experts(model.cfg)
        plain.gate_up_proj.data, plain.down_proj.data = dense[f"{name}.gate_up_proj"], dense[f"{name}.down_proj"]
        parent, _, child = name.rpartition(".")
        setattr(twin.get_submodule(parent), child, plain.requires_grad_(False))
    ids = _prompt(50, seed=6)
    assert rel_err(Session(model, 64).extend(ids, all_logits=True), Session(twin, 64).extend(ids, all_logits=True)) < TOL


def test_weight_bytes_count_a_tied_head_once():
    """A tied head is the embedding's tensor itself (the loader shares it): the memory plan's weight bytes count it
    once, as the device holds it once."""
    from flashnext.engine.loading import _state_bytes

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(32, 8)
    model.head = torch.nn.Linear(8, 32, bias=False)
    model.head.weight = model.embed.weight
    assert _state_bytes(model, "cpu") == 32 * 8 * 4
