"""Presets and synthetic checkpoints: configs transformers accepts, real layouts, PLE constants, tokenizer."""

import json
import math

import pytest
import torch
from safetensors import safe_open

from flashnext.weights.checkpoint import load_checkpoint
from flashnext.weights.presets import PRESETS, generation_config, get_preset, special_token_ids
from flashnext.weights.synth import ple_buffers, random_tensor, synthesize, synthesize_state_dict

transformers = pytest.importorskip("transformers")


def hf_config(config):
    return transformers.AutoConfig.for_model(**json.loads(json.dumps(config)))


def meta_expected(config):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(config))
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


@pytest.mark.parametrize("name,params,layers", [
    ("flash-next", 176.94e9, 48), ("qwen3-next-80b", 79.67e9, 48), ("qwen3.5-35b", 34.66e9, 40)])
def test_full_size_presets_match_the_releases(name, params, layers):
    config = get_preset(name)
    text = hf_config(config).get_text_config()
    assert text.num_hidden_layers == layers
    assert text.layer_types[3] in ("full_attention", "indexed_attention") and text.layer_types[0] == "linear_attention"
    assert text.rope_parameters["rope_theta"] == 1e7 and text.rope_parameters["partial_rotary_factor"] == 0.25
    total = sum(math.prod(shape) for shape, _ in meta_expected(config).values())
    assert abs(total - params) / params < 1e-3, total


def test_flash_next_preset_values():
    config = get_preset("flash-next")
    text = config["text_config"]
    assert config["model_type"] == "qwen4_exp" and text["model_type"] == "qwen4_exp_text"
    assert text["layer_types"].count("full_attention") == 12  # the real checkpoint says full_attention
    assert text["rope_parameters"] == {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                                       "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    assert special_token_ids(config) == {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046}
    assert special_token_ids(get_preset("qwen3-next-80b"))["<|im_end|>"] == 151645
    gen = generation_config(config)
    assert gen["eos_token_id"] == [248046, 248044]
    assert (gen["temperature"], gen["top_p"], gen["top_k"]) == (0.6, 0.95, 20)


def test_get_preset_layers_override():
    config = get_preset("tiny-flash-next", layers=9)
    text = config["text_config"]
    assert text["num_hidden_layers"] == 9 and len(text["layer_types"]) == 9
    assert [i for i, t in enumerate(text["layer_types"]) if t != "linear_attention"] == [3, 7]
    assert get_preset("tiny-qwen3-next", layers=2)["layer_types"] == ["linear_attention"] * 2
    assert hf_config(get_preset("qwen3.5-35b", layers=8)).get_text_config().num_hidden_layers == 8
    assert get_preset("tiny-flash-next")["text_config"]["num_hidden_layers"] == 4  # presets are not mutated
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        get_preset("nope")
    assert set(PRESETS) >= {"flash-next", "qwen3-next-80b", "qwen3.5-35b", "tiny-flash-next", "tiny-qwen3-next",
                            "tiny-qwen3.5-moe"}


def test_ple_buffers_equal_transformers_derivation():
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    text = get_preset("flash-next")["text_config"]
    ours = ple_buffers(text, 0)
    assert torch.equal(ours["layer_multipliers"], hf._build_layer_multipliers(text["vocab_size"], 3, 0, 1234))
    tiny = hf_config(get_preset("tiny-flash-next")).get_text_config()
    tiny.ple_layer_ids = [2, 3]
    for index in range(2):
        module = hf.Qwen4ExpTextNGramEmbedding(tiny, 64, layer_idx=index + 1, ple_layer_index=index)
        buffers = ple_buffers(tiny.to_dict(), index)
        for name in buffers:
            assert torch.equal(buffers[name], getattr(module, name)), (index, name)
    sizes = ours["ngram_heads_vocab_sizes"]
    assert sizes.numel() == 16 and math.ceil(sizes.sum().item() / 128) * 128 == 320_001_536  # MODEL.md's row count


@pytest.mark.parametrize("preset,layout", [
    ("tiny-flash-next", "model.language_model.layers.0.mlp.experts.gate_up_proj"),
    ("tiny-qwen3-next", "model.layers.0.mlp.experts.7.up_proj.weight"),
    ("tiny-qwen3.5-moe", "model.language_model.layers.0.mlp.experts.gate_up_proj")])
def test_synthetic_folder_layout(preset, layout, tmp_path):
    config = get_preset(preset)
    folder = synthesize(preset, tmp_path, expected=meta_expected(config), shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert layout in index["weight_map"]
    if preset == "tiny-flash-next":
        assert "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_1.weight" in index["weight_map"]
    assert all(key.startswith(("model.", "lm_head.")) for key in index["weight_map"])
    with safe_open(str(tmp_path / index["weight_map"]["lm_head.weight"]), "pt") as f:
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"
    ids = special_token_ids(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == ids["<|im_end|>"]
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == ids["<|endoftext|>"] == 486
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [
        ids["<|im_end|>"], ids["<|endoftext|>"]]


def test_random_values_are_zero_mean_and_scaled():
    w = random_tensor("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 256), seed=0, dtype=torch.float32)
    assert abs(w.mean()) < 0.01 and abs(w.std() - 1 / 16) < 0.005
    a_log = random_tensor("model.layers.0.linear_attn.A_log", (4096,), seed=0, dtype=torch.float32)
    assert a_log.exp().min() >= 0.01 and a_log.exp().max() <= 2.0
    norm = random_tensor("model.layers.0.input_layernorm.weight", (4096,), seed=0, dtype=torch.float32)
    assert abs(norm.std() - 0.2) < 0.02 and abs(norm.mean()) < 0.02
    assert torch.equal(w, random_tensor("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 256), seed=0,
                                        dtype=torch.float32))
    assert not torch.equal(w, random_tensor("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 256), seed=1,
                                            dtype=torch.float32))


def test_deep_random_model_stays_finite():
    # Flash-Next has no pre-norms: block outputs pile up in the hyper-connection streams over 48 layers.
    config = get_preset("tiny-flash-next", layers=48)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(config)).float()
    state = synthesize_state_dict(config, "bf16", seed=3, expected=meta_expected(config), out_dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    logits = model(torch.randint(0, 480, (1, 8))).logits
    assert torch.isfinite(logits).all() and 0.1 < logits.std() < 100


def test_state_dict_equals_loaded_checkpoint(tmp_path):
    config = get_preset("tiny-qwen3.5-moe", layers=2)
    expected = meta_expected(config)
    folder = synthesize(config, tmp_path, dtype="int4", seed=5, expected=expected)
    loaded = load_checkpoint(folder, expected, progress=False)
    in_memory = synthesize_state_dict(config, "int4", seed=5, expected=expected)
    assert all(torch.equal(loaded[k], in_memory[k]) for k in expected)
    assert in_memory["model.embed_tokens.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("preset", ["tiny-flash-next", "tiny-qwen3-next", "tiny-qwen3.5-moe"])
def test_expected_tensors_of_our_model_match_transformers(preset):
    from flashnext.weights.synth import expected_tensors

    config = get_preset(preset)
    ours, theirs = expected_tensors(config), meta_expected(config)
    assert list(ours) == list(theirs) or set(ours) == set(theirs)
    assert all(ours[k][0] == theirs[k][0] and ours[k][1].is_floating_point == theirs[k][1].is_floating_point
               for k in theirs)
