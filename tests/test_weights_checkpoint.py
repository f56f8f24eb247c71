"""load_checkpoint against transformers: synthetic folders, save_pretrained folders, and broken folders."""

import json
import logging
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashnext.weights.checkpoint import CheckpointError, load_checkpoint
from flashnext.weights.fp8 import dequantize_block_fp8, quantize_block_fp8
from flashnext.weights.hub import resolve_model_path
from flashnext.weights.int4 import dequantize_gptq, quantize_gptq_rtn
from flashnext.weights.presets import get_preset
from flashnext.weights.quant_config import read_quantization_config
from flashnext.weights.synth import synthesize, synthesize_state_dict

transformers = pytest.importorskip("transformers")
TINY = ["tiny-flash-next", "tiny-qwen3-next", "tiny-qwen3.5-moe"]


def hf_config(config: dict):
    return transformers.AutoConfig.for_model(**json.loads(json.dumps(config)))


@lru_cache
def hf_expected(preset: str) -> dict:
    """Our canonical keys come from transformers' text-only CausalLM, listed on the meta device."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(get_preset(preset)))
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


@lru_cache
def synthetic(preset: str, kind: str, root: str) -> Path:
    return synthesize(preset, Path(root) / f"{preset}-{kind}", dtype=kind, expected=hf_expected(preset))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("synth"))


def files_of(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {f.name: load_file(f) for f in sorted(folder.glob("*.safetensors"))}


def raw_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for tensors in files_of(folder).values() for k, v in tensors.items()}


@pytest.mark.parametrize("preset", TINY)
def test_synthetic_bf16_loads_in_transformers_and_matches(preset, root):
    folder = synthetic(preset, "bf16", root)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True,
                                                                     dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = load_checkpoint(folder, hf_expected(preset), dtype=torch.float32, progress=False)
    theirs = model.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == (torch.float32 if tensor.is_floating_point() else tensor.dtype)
        assert torch.equal(ours[name], tensor), name
    logits = model(torch.randint(0, 480, (1, 70))).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1


@pytest.mark.parametrize("kind", ["int4", "fp8"])
@pytest.mark.parametrize("preset", TINY)
def test_synthetic_quantised_loads_dequantised(preset, kind, root):
    folder = synthetic(preset, kind, root)
    expected = hf_expected(preset)
    ours = load_checkpoint(folder, expected, dtype=torch.float32, progress=False)
    raw = raw_tensors(folder)
    prefix = "model." if preset == "tiny-qwen3-next" else "model.language_model."
    expert = prefix + "layers.0.mlp.experts.1"
    dense = prefix + "layers.3.self_attn.o_proj"
    if kind == "int4":
        def deq(base):
            return dequantize_gptq(raw[base + ".qweight"], raw[base + ".qzeros"], raw[base + ".scales"])
        assert read_quantization_config(json.loads((folder / "config.json").read_text())).group_size == 32
        assert (prefix + "layers.0.mlp.gate") in json.loads((folder / "config.json").read_text())[
            "quantization_config"]["extra_config"]
    else:
        def deq(base):
            return dequantize_block_fp8(raw[base + ".weight"], raw[base + ".weight_scale_inv"])
    gate_up = ours["model.layers.0.mlp.experts.gate_up_proj"][1]
    assert torch.equal(gate_up, torch.cat([deq(expert + ".gate_proj"), deq(expert + ".up_proj")]))
    assert torch.equal(ours["model.layers.0.mlp.experts.down_proj"][1], deq(expert + ".down_proj"))
    assert torch.equal(ours["model.layers.3.self_attn.o_proj.weight"], deq(dense))
    # 16-bit modules stay 16-bit, and the quantised weights are close to the bf16 checkpoint's.
    assert raw[prefix + "layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    bf16 = load_checkpoint(synthetic(preset, "bf16", root), expected, dtype=torch.float32, progress=False)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.self_attn.o_proj.weight"):
        error = (ours[name] - bf16[name]).norm() / bf16[name].norm()
        assert 0 < error < (0.15 if kind == "int4" else 0.05), (name, error)
    assert torch.equal(ours["model.layers.0.mlp.gate.weight"], bf16["model.layers.0.mlp.gate.weight"])
    in_memory = synthesize_state_dict(get_preset(preset), kind, 0, expected=expected)
    loaded = load_checkpoint(folder, expected, progress=False)
    assert all(torch.equal(in_memory[k], loaded[k]) for k in expected)


def randomise(model: torch.nn.Module) -> None:
    """Default init zeroes norms and the PLE conv, which would hide layout bugs."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))


@pytest.mark.parametrize("preset", TINY)
def test_save_pretrained_folder_loads(preset, tmp_path):
    config = get_preset(preset)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(config))
    randomise(model)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_checkpoint(tmp_path, hf_expected(preset), dtype=torch.float32, progress=False)
    for name, tensor in model.state_dict().items():
        assert torch.equal(ours[name], tensor), name


def write(folder: Path, tensors: dict, config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


EXPECTED = {"model.embed_tokens.weight": ((16, 8), torch.float32), "lm_head.weight": ((16, 8), torch.float32)}


def test_errors_name_the_problem(tmp_path):
    good = {"model.embed_tokens.weight": torch.randn(16, 8), "lm_head.weight": torch.randn(16, 8)}
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): lm_head.weight"):
        load_checkpoint(write(tmp_path / "a", {"model.embed_tokens.weight": good["lm_head.weight"]}), EXPECTED)
    with pytest.raises(CheckpointError, match=r"lm_head.weight has the wrong shape: expected \(16, 8\), got \(16, 4\)"):
        load_checkpoint(write(tmp_path / "b", {**good, "lm_head.weight": torch.randn(16, 4)}), EXPECTED)
    with pytest.raises(CheckpointError, match=r"2 tensor\(s\) this model does not use: model.extra.a, model.extra.b"):
        load_checkpoint(write(tmp_path / "c", {**good, "model.extra.a": torch.ones(1), "model.extra.b": torch.ones(1)}),
                        EXPECTED)
    many = {f"model.layers.{i}.weight": ((1,), torch.float32) for i in range(25)}
    with pytest.raises(CheckpointError, match=r"missing 25 tensor\(s\): .*and 15 more"):
        load_checkpoint(tmp_path / "c", {**EXPECTED, **many})
    folder = write(tmp_path / "d", good)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-40])
    with pytest.raises(CheckpointError, match=r"d/model.safetensors is not a readable safetensors file"):
        load_checkpoint(folder, EXPECTED)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(folder, EXPECTED)
    save_file({"lm_head.weight": good["lm_head.weight"]}, str(folder / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors",
                            "model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"lists 1 shard file\(s\) that are not in the folder: model-00002"):
        load_checkpoint(folder, EXPECTED)
    with pytest.raises(ValueError, match="quantization method 'awq' is not supported"):
        load_checkpoint(write(tmp_path / "e", good, {"quantization_config": {"quant_method": "awq"}}), EXPECTED)


def test_multimodal_prefix_and_skipped_groups(tmp_path, caplog):
    tensors = {"model.language_model.embed_tokens.weight": torch.randn(16, 8), "lm_head.weight": torch.randn(16, 8),
               "model.visual.blocks.0.w": torch.ones(2), "model.visual.blocks.1.w": torch.ones(2),
               "mtp.fc.weight": torch.ones(2)}
    with caplog.at_level(logging.INFO, logger="flashnext.weights.checkpoint"):
        out = load_checkpoint(write(tmp_path, tensors), EXPECTED, dtype=torch.float32, progress=False)
    assert torch.equal(out["model.embed_tokens.weight"], tensors["model.language_model.embed_tokens.weight"])
    lines = [r.getMessage() for r in caplog.records]
    assert "skipping 2 vision tower tensors (not used for text generation)" in lines
    assert "skipping 1 multi-token-prediction (MTP) tensors (not used for text generation)" in lines
    assert len(lines) == 2


def test_fused_experts_transposed_and_per_expert_quantised(tmp_path):
    experts, inter, hidden = 3, 8, 32
    gate_up = torch.randn(experts, 2 * inter, hidden)
    down = torch.randn(experts, hidden, inter)
    expected = {"model.layers.0.mlp.experts.gate_up_proj": ((experts, 2 * inter, hidden), torch.float32),
                "model.layers.0.mlp.experts.down_proj": ((experts, hidden, inter), torch.float32),
                "model.layers.0.mlp.gate.weight": ((8, hidden), torch.float32)}
    # Qwen3-VL-MoE style: fused experts stored [E, in, out].
    router = torch.randn(8, hidden)
    folder = write(tmp_path / "t", {"model.layers.0.mlp.experts.gate_up_proj": gate_up.transpose(1, 2).contiguous(),
                                    "model.layers.0.mlp.experts.down_proj": down.transpose(1, 2).contiguous(),
                                    "model.layers.0.mlp.gate.weight": router})
    out = load_checkpoint(folder, expected, dtype=torch.float32, progress=False)
    assert torch.equal(out["model.layers.0.mlp.experts.gate_up_proj"], gate_up)
    assert torch.equal(out["model.layers.0.mlp.experts.down_proj"], down)
    # Per-expert int4 with act-order (non-monotone g_idx), fp8 down projections, and a router stored as int4.
    tensors, want = {}, torch.empty(experts, 2 * inter, hidden)
    for e in range(experts):
        for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, None))):
            packed = quantize_gptq_rtn(gate_up[e, rows], group_size=16, desc_act_perm=torch.randperm(hidden))
            tensors.update({f"model.layers.0.mlp.experts.{e}.{proj}.{k}": v for k, v in packed.items()})
            want[e, rows] = dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"])
        q, scale = quantize_block_fp8(down[e])
        tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = q
        tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight_scale_inv"] = scale
    packed = quantize_gptq_rtn(router, group_size=32, sym=False)
    tensors.update({f"model.layers.0.mlp.gate.{k}": v for k, v in packed.items()})
    out = load_checkpoint(write(tmp_path / "q", tensors), expected, dtype=torch.float32, progress=False)
    assert torch.equal(out["model.layers.0.mlp.experts.gate_up_proj"], want)
    assert torch.equal(out["model.layers.0.mlp.experts.down_proj"],
                       torch.stack([dequantize_block_fp8(tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"],
                                    tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight_scale_inv"])
                                    for e in range(experts)]))
    assert torch.equal(out["model.layers.0.mlp.gate.weight"],
                       dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"]))
    del tensors["model.layers.0.mlp.experts.2.up_proj.qweight"]
    with pytest.raises(CheckpointError, match=r"missing 1 expert tensor\(s\): model.layers.0.mlp.experts.2.up_proj"):
        load_checkpoint(write(tmp_path / "m", tensors), expected, progress=False)


def test_expert_range_reads_only_that_share(tmp_path, monkeypatch):
    """Expert parallel's loading: experts [2, 4) of 5 come back stacked [2, ...], equal to those rows of the full
    load, from fused, transposed-fused and per-expert (bf16 and packed int4) checkpoints; the other experts'
    tensors are never read, and are not reported as unexpected."""
    from flashnext.weights import checkpoint
    from flashnext.weights.int4_layout import Int4Weight

    experts, inter, hidden = 5, 16, 32
    gate_up, down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    prefix = "model.layers.0.mlp.experts"
    expected = {f"{prefix}.gate_up_proj": ((experts, 2 * inter, hidden), torch.float32),
                f"{prefix}.down_proj": ((experts, hidden, inter), torch.float32)}
    per_expert, per_expert_int4 = {}, {}
    for e in range(experts):
        for proj, w in (("gate_proj", gate_up[e, :inter]), ("up_proj", gate_up[e, inter:]), ("down_proj", down[e])):
            per_expert[f"{prefix}.{e}.{proj}.weight"] = w
            per_expert_int4.update({f"{prefix}.{e}.{proj}.{k}": v for k, v in quantize_gptq_rtn(w, 16).items()})
    folders = {"fused": write(tmp_path / "f", {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}),
               "transposed": write(tmp_path / "t", {f"{prefix}.gate_up_proj": gate_up.transpose(1, 2).contiguous(),
                                                    f"{prefix}.down_proj": down.transpose(1, 2).contiguous()}),
               "per expert": write(tmp_path / "p", per_expert), "int4": write(tmp_path / "q", per_expert_int4)}
    read, row_reads = [], []
    original = checkpoint._Tensors.read
    monkeypatch.setattr(checkpoint._Tensors, "read", lambda self, name, device: read.append(name) or
                        original(self, name, device))
    original_rows = checkpoint._Tensors.read_rows
    monkeypatch.setattr(checkpoint._Tensors, "read_rows", lambda self, name, first, count, device:
                        row_reads.append((first, count)) or original_rows(self, name, first, count, device))
    for kind, folder in folders.items():
        options = dict(dtype=torch.float32, progress=False, packed_int4=frozenset(expected) if kind == "int4"
                       else frozenset())
        full = load_checkpoint(folder, expected, **options)
        read.clear()
        row_reads.clear()
        share = load_checkpoint(folder, expected, expert_range=(2, 2), **options)
        for name in expected:
            got, want = share[name], full[name]
            if isinstance(want, Int4Weight):
                assert isinstance(got, Int4Weight) and got.qweight.shape[0] == 2, kind
                for field, tensor in want.tensors().items():             # codes, scales, zeros: the same experts
                    assert torch.equal(got.tensors()[field], tensor[2:4]), (kind, name, field)
                got, want = got.qweight, want.qweight
            assert torch.equal(got, want[2:4]), (kind, name)
        assert not [n for n in read if any(f"experts.{e}." in n for e in (0, 1, 4))], (kind, read)
        assert bool(read) == (kind in ("per expert", "int4")), kind   # fused ones: read_rows, the share's rows
        if kind in ("fused", "transposed"):
            assert row_reads and set(row_reads) == {(2, 2)}, (kind, row_reads)
    with pytest.raises(ValueError, match=r"expert range \(4, 2\) does not fit the model's experts \[5\]"):
        load_checkpoint(folders["fused"], expected, expert_range=(4, 2), progress=False)


def test_ngram_shards_checked_against_config(tmp_path):
    expected = {"model.layers.1.ple.ple_embedding.ngram_embedding.weight": ((12, 4), torch.float32)}
    shards = {f"model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_{i}.weight": torch.randn(4, 4)
              for i in range(3)}
    config = {"model_type": "qwen4_exp", "text_config": {"split_ngram_parts": 3}}
    out = load_checkpoint(write(tmp_path / "a", shards, config), expected, dtype=torch.float32, progress=False)
    assert torch.equal(out[next(iter(expected))], torch.cat(list(shards.values())))
    config["text_config"]["split_ngram_parts"] = 4
    with pytest.raises(CheckpointError, match="split_ngram_parts=4 but the checkpoint has 3 shards"):
        load_checkpoint(write(tmp_path / "b", shards, config), expected, progress=False)


def test_quantization_config_parsing():
    qc = read_quantization_config({"quantization_config": {
        "quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True,
        "packing_format": "auto_round:auto_gptq", "extra_config": {"model.layers.0.mlp.gate": {"bits": 16}}}})
    assert (qc.method, qc.bits, qc.group_size, qc.zeros_minus_one) == ("auto-round", 4, 128, True)
    override = read_quantization_config({"quantization_config": {
        "quant_method": "auto-round", "sym": True, "extra_config": {"model.layers.3.self_attn.o_proj": {"sym": False}}}})
    assert not override.symmetric("model.layers.3.self_attn.o_proj")
    assert not override.symmetric("model.language_model.layers.3.self_attn.o_proj")      # a multimodal prefix
    assert override.symmetric("model.layers.3.self_attn.q_proj") and override.symmetric("model.layers.13.self_attn.o_proj")
    assert not read_quantization_config({"quantization_config": {"quant_method": "gptq",
                                                                 "checkpoint_format": "gptq_v2"}}).zeros_minus_one
    assert read_quantization_config({"quantization_config": {"quant_method": "fp8",
                                                             "weight_block_size": [64, 64]}}).fp8_block == (64, 64)
    with pytest.raises(ValueError, match="packing format 'auto_round:auto_awq' is not supported"):
        read_quantization_config({"quantization_config": {"quant_method": "auto-round",
                                                          "packing_format": "auto_round:auto_awq"}})


def test_resolve_model_path(tmp_path):
    assert resolve_model_path(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(tmp_path / "nope")
    code = ("from flashnext.weights.hub import resolve_model_path\n"
            "try:\n    resolve_model_path('flashnext-test/no-such-model')\n"
            "except FileNotFoundError as e:\n    print('ERR', e)\n")
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "ERR flashnext-test/no-such-model is neither a local folder nor in the Hugging Face cache" in result.stdout, (
        result.stdout + result.stderr)


@pytest.mark.parametrize("odd", ["symmetric first expert", "symmetric later expert", "symmetric gate of one expert",
                                 "other group size"])
def test_stacked_int4_experts_that_differ_load_exactly(tmp_path, odd):
    """Per-expert INT4 experts stacked into one Int4Weight when one expert differs from the others: an asymmetric
    checkpoint where one expert's zero points are all 8 (read as symmetric: no zeros) had every expert of the layer
    taken as symmetric when it came first — silently wrong — and crashed when it came later; a different group size
    crashed the stack (session 15's bug hunt). Each must equal the dequantised pieces."""
    from flashnext.weights.int4_layout import Int4Weight, dequantize

    experts, inter, hidden = 3, 16, 64
    special = 0 if odd == "symmetric first expert" else 1
    gate_up, down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    prefix = "model.layers.0.mlp.experts"
    tensors, want_gate_up = {}, torch.empty_like(gate_up)
    for e in range(experts):
        group = 32 if odd == "other group size" and e == special else 16
        for proj, w, rows in (("gate_proj", gate_up[e, :inter], slice(0, inter)),
                              ("up_proj", gate_up[e, inter:], slice(inter, 2 * inter))):
            sym = e == special and odd.startswith("symmetric") and (proj == "gate_proj" or "gate" not in odd)
            packed = quantize_gptq_rtn(w, group_size=group, sym=sym)
            tensors.update({f"{prefix}.{e}.{proj}.{k}": v for k, v in packed.items()})
            want_gate_up[e, rows] = dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"])
        tensors.update({f"{prefix}.{e}.down_proj.{k}": v for k, v in quantize_gptq_rtn(down[e], 16).items()})
    expected = {f"{prefix}.gate_up_proj": ((experts, 2 * inter, hidden), torch.float32),
                f"{prefix}.down_proj": ((experts, hidden, inter), torch.float32)}
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 16, "sym": False}}
    loaded = load_checkpoint(write(tmp_path, tensors, config), expected, dtype=torch.float32, progress=False,
                             packed_int4=frozenset(expected))
    got = loaded[f"{prefix}.gate_up_proj"]
    assert isinstance(got, Int4Weight) == (odd != "other group size")   # packed unless it cannot be
    got = dequantize(got).float() if isinstance(got, Int4Weight) else got
    assert torch.allclose(got, want_gate_up, atol=1e-6), (got - want_gate_up).abs().max()


def test_stacked_int4_experts_of_a_symmetric_checkpoint_keep_no_zero_points(tmp_path):
    """from_gptq drops all-8 zero points; stacking the experts must not fill them back (memory, and the kernels'
    asymmetric path): only a layer where some piece has zero points of its own gets 8s for the others."""
    from flashnext.weights.int4_layout import Int4Weight, dequantize

    experts, inter, hidden = 3, 16, 64
    prefix = "model.layers.0.mlp.experts"
    weights = {"gate_up_proj": torch.randn(experts, 2 * inter, hidden),
               "down_proj": torch.randn(experts, hidden, inter)}
    tensors, want = {}, {kind: torch.empty_like(w) for kind, w in weights.items()}
    for e in range(experts):
        for proj, kind, rows in (("gate_proj", "gate_up_proj", slice(0, inter)),
                                 ("up_proj", "gate_up_proj", slice(inter, None)),
                                 ("down_proj", "down_proj", slice(None))):
            packed = quantize_gptq_rtn(weights[kind][e, rows], group_size=16)
            tensors.update({f"{prefix}.{e}.{proj}.{k}": v for k, v in packed.items()})
            want[kind][e, rows] = dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"])
    expected = {f"{prefix}.{kind}": (tuple(w.shape), torch.float32) for kind, w in weights.items()}
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 16, "sym": True}}
    loaded = load_checkpoint(write(tmp_path, tensors, config), expected, dtype=torch.float32, progress=False,
                             packed_int4=frozenset(expected))
    for kind in weights:
        got = loaded[f"{prefix}.{kind}"]
        assert isinstance(got, Int4Weight) and got.zeros is None, kind
        assert torch.allclose(dequantize(got), want[kind], atol=1e-6), kind


def test_a_tied_head_comes_from_the_embedding(tmp_path, monkeypatch):
    """tie_word_embeddings: save_pretrained writes no lm_head.weight; the head is the embedding, as in transformers (it
    had failed as a missing tensor). The embedding is read once and the head is that very tensor, whichever name comes
    first and although the load converts its dtype (it had been read twice into two copies). Untied, a missing head
    is still an error."""
    from flashnext.weights import checkpoint

    embed = torch.randn(16, 8).bfloat16()
    folder = write(tmp_path / "tied", {"model.embed_tokens.weight": embed}, {"tie_word_embeddings": True})
    reads = []
    original = checkpoint._Tensors.read
    monkeypatch.setattr(checkpoint._Tensors, "read", lambda self, name, device: reads.append(name) or
                        original(self, name, device))
    for expected in (EXPECTED, dict(reversed(EXPECTED.items()))):
        reads.clear()
        loaded = load_checkpoint(folder, expected, dtype=torch.float32, progress=False)
        assert torch.equal(loaded["model.embed_tokens.weight"], embed.float())
        assert loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"]
        assert reads == ["model.embed_tokens.weight"]
    nested = write(tmp_path / "nested", {"model.embed_tokens.weight": embed},
                   {"text_config": {"tie_word_embeddings": True}})
    assert torch.equal(load_checkpoint(nested, EXPECTED, dtype=torch.float32, progress=False)["lm_head.weight"],
                       embed.float())
    untied = write(tmp_path / "untied", {"model.embed_tokens.weight": embed}, {})
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_checkpoint(untied, EXPECTED, dtype=torch.float32, progress=False)


def test_a_layer_declared_asymmetric_by_extra_config_loads_packed(tmp_path):
    """A global "sym": true with one layer overridden "sym": false in extra_config: that layer loads packed with its
    zero points (it had failed with an unnamed ValueError); a symmetric-declared layer with other zero points is a
    CheckpointError naming the tensor."""
    from flashnext.weights.int4_layout import Int4Weight, dequantize

    w = torch.randn(32, 64)
    packed = quantize_gptq_rtn(w, group_size=16, sym=False)
    tensors = {f"model.layers.3.self_attn.o_proj.{k}": v for k, v in packed.items()}
    expected = {"model.layers.3.self_attn.o_proj.weight": ((32, 64), torch.float32)}
    quant = {"quant_method": "auto-round", "bits": 4, "group_size": 16, "sym": True,
             "packing_format": "auto_round:auto_gptq"}
    folder = write(tmp_path / "o", tensors, {"quantization_config": {
        **quant, "extra_config": {"model.layers.3.self_attn.o_proj": {"sym": False}}}})
    loaded = load_checkpoint(folder, expected, dtype=torch.float32, progress=False, packed_int4=frozenset(expected))
    got = loaded["model.layers.3.self_attn.o_proj.weight"]
    assert isinstance(got, Int4Weight) and got.zeros is not None
    assert torch.allclose(dequantize(got).float(), dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"]),
                          atol=1e-6)
    declared = write(tmp_path / "d", tensors, {"quantization_config": quant})
    with pytest.raises(CheckpointError, match="model.layers.3.self_attn.o_proj"):
        load_checkpoint(declared, expected, dtype=torch.float32, progress=False, packed_int4=frozenset(expected))


def test_config_refuses_a_quantization_the_loader_cannot_read():
    """config.json's quantization_config goes through the loader's parse when the config is read: a packing it cannot
    load fails there, by field, before any weight is read (and a supported one passes)."""
    from flashnext.weights.config import ConfigError, parse_config

    raw = dict(get_preset("tiny-qwen3-next"))
    raw["quantization_config"] = {"quant_method": "auto-round", "packing_format": "auto_round:awq"}
    with pytest.raises(ConfigError, match="quantization_config: AutoRound packing format 'auto_round:awq'"):
        parse_config(raw)
    raw["quantization_config"] = {"quant_method": "auto_round", "packing_format": "auto_round:auto_gptq"}
    assert parse_config(raw).quantization["quant_method"] == "auto_round"
