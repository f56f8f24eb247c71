"""compressed-tensors pack-quantized weights (weights/compressed_tensors.py) against the compressed_tensors library's
own compressor and decompress (the format's reference), and such checkpoints loaded whole."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashnext.weights import compressed_tensors as ct
from flashnext.weights.checkpoint import CheckpointError, load_checkpoint
from flashnext.weights.int4_layout import dequantize as dequantize_int4
from flashnext.weights.quant_config import read_quantization_config
from flashnext.weights.synth import expected_tensors, synthesize

library = pytest.importorskip("compressed_tensors",
                              reason="compressed-tensors (a test dependency) is the format's oracle")
from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402


def scheme(bits, sym, strategy, group):
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", symmetric=sym, strategy=strategy, group_size=group if strategy == "group" else None))


def compressed(bits, sym, strategy, group=32, n=48, k=256, seed=0):
    """A random [n, k] weight through compressed_tensors' compressor with random fp32 scales (and int8 zero points)
    → (the stored tensors without a module prefix, the scheme)."""
    g = torch.Generator().manual_seed(seed)
    groups = k // group if strategy == "group" else 1
    half = 1 << (bits - 1)
    state = {"weight": torch.randn(n, k, generator=g),
             "weight_scale": torch.rand(n, groups, generator=g) * 0.1 + 0.01}
    if not sym:
        state["weight_zero_point"] = torch.randint(-half, half, (n, groups), generator=g, dtype=torch.int8)
    s = scheme(bits, sym, strategy, group)
    return dict(PackedQuantizationCompressor.compress(state, s)), s


def decompressed(parts, s):
    return PackedQuantizationCompressor.decompress(dict(parts), s)["weight"]


CASES = [(4, True, "group"), (4, False, "group"), (4, True, "channel"), (4, False, "channel"), (8, True, "group"),
         (8, False, "group")]


@pytest.mark.parametrize("bits,sym,strategy", CASES)
def test_dequantise_equals_the_library(bits, sym, strategy):
    parts, s = compressed(bits, sym, strategy)
    assert set(parts) <= set(ct.PARTS) and (ct.ZERO_POINT in parts) == (not sym)
    assert ct.bits_of(tuple(parts[ct.PACKED].shape), (48, 256)) == bits
    want = decompressed(parts, s)
    assert torch.equal(ct.dequantize(parts, bits), want)
    if bits == 4:   # the kernel layout's Int4Weight holds the same weight
        w = ct.to_int4(parts)
        assert (w.zeros is None) == sym and w.perm is None
        assert w.group_size == (32 if strategy == "group" else 256)
        assert torch.equal(dequantize_int4(w), want)


@pytest.mark.parametrize("sym", [True, False])
def test_our_writer_is_read_by_the_library(sym):
    weight = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    parts = ct.quantize_rtn(weight, group_size=32, sym=sym, scale_dtype=torch.float32)
    want = decompressed(parts, scheme(4, sym, "group", 32))
    assert torch.equal(ct.dequantize(parts, 4), want)
    assert ((want - weight).norm() / weight.norm()).item() < 0.15


def test_act_order_groups_become_the_permutation():
    """Older exports (actorder "group") store weight_g_idx: input k belongs to group g_idx[k], not k // g."""
    parts, _ = compressed(4, False, "group", group=32, n=16, k=128, seed=2)
    g_idx = torch.randperm(128, generator=torch.Generator().manual_seed(3)) // 32
    parts = {**parts, ct.G_IDX: g_idx.to(torch.int32)}
    got = ct.dequantize(parts, 4)
    codes = torch.tensor([[(int(parts[ct.PACKED][n, k // 8]) >> (4 * (k % 8))) & 0xF for k in range(128)]
                          for n in range(16)])
    zeros = unpack_from_int32(parts[ct.ZERO_POINT], 4, torch.Size((16, 4)), packed_dim=0).long() + 8   # stored offset
    want = parts[ct.SCALE][:, g_idx] * (codes - zeros[:, g_idx]).float()
    assert torch.equal(got, want)
    w = ct.to_int4(parts)
    assert w.perm is not None and torch.equal(dequantize_int4(w), got)


def test_misfits_are_refused():
    parts, _ = compressed(4, True, "group")
    assert ct.bits_of((48, 33), (48, 256)) == 0 and ct.bits_of((47, 32), (48, 256)) == 0
    with pytest.raises(ValueError, match="weight_packed"):
        ct.to_int4({**parts, ct.SHAPE: torch.tensor([48, 512])})
    asym, _ = compressed(4, False, "group")
    with pytest.raises(ValueError, match="zero points"):
        ct.to_int4({**parts, ct.ZERO_POINT: asym[ct.ZERO_POINT][:, :3]})


def unpacked(kind, sym, strategy, n=48, k=256, seed=0):
    """A random [n, k] weight through compressed_tensors' naive compressor: fp8 ("float") or int8, scales for the
    strategy (group 32, blocks of 16 × 64), fp32 → (the stored tensors without a module prefix, the scheme)."""
    g = torch.Generator().manual_seed(seed)
    shape = {"tensor": (1,), "channel": (n, 1), "group": (n, k // 32), "block": (-(-n // 16), -(-k // 64))}[strategy]
    state = {"weight": torch.randn(n, k, generator=g), "weight_scale": torch.rand(shape, generator=g) * 0.01 + 1e-3}
    if not sym:
        state["weight_zero_point"] = torch.randint(-100, 100, shape, generator=g, dtype=torch.int8)
    s = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type=kind, symmetric=sym, strategy=strategy, group_size=32 if strategy == "group" else None,
        block_structure=[16, 64] if strategy == "block" else None))
    return dict(NaiveQuantizationCompressor.compress(state, s)), s


@pytest.mark.parametrize("kind,sym,strategy", [("float", True, "channel"), ("float", True, "tensor"),
                                                ("float", True, "block"), ("float", True, "group"),
                                                ("int", True, "channel"), ("int", False, "channel"),
                                                ("int", False, "group")])
def test_unpacked_dequantise_equals_the_library(kind, sym, strategy):
    parts, s = unpacked(kind, sym, strategy)
    weight = parts.pop("weight")
    assert weight.dtype == (torch.float8_e4m3fn if kind == "float" else torch.int8)
    want = NaiveQuantizationCompressor.decompress({**parts, "weight": weight}, s)["weight"]
    got = ct.dequantize_unpacked(weight, parts, (16, 64) if strategy == "block" else None)
    assert torch.equal(got, want)


def test_quantization_config_parsing():
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                           "group_size": 64}}}, "ignore": ["lm_head"]}
    qc = read_quantization_config({"quantization_config": config})
    assert (qc.method, qc.bits, qc.group_size, qc.sym) == ("compressed-tensors", 4, 64, False)
    preset = read_quantization_config({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"W4A16": ["Linear"]}}})
    assert (preset.bits, preset.group_size, preset.sym) == (4, 128, True)
    assert not qc.activations_quantised
    fp8 = read_quantization_config({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                               "block_structure": [64, 32]},
            "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}})
    assert (fp8.bits, fp8.weight_block, fp8.activations_quantised) == (8, (64, 32), True)
    mixed = read_quantization_config({"quantization_config": {    # each group names its format
        "quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {
            "int4": {**config["config_groups"]["group_0"], "format": "pack-quantized"},
            "fp8": {"targets": ["re:.*self_attn.*"], "format": "float-quantized",
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}})
    assert (mixed.bits, mixed.group_size) == (8, 64)
    refused = {
        "output activation": {"config_groups": {"g": {**config["config_groups"]["group_0"],
                                                     "output_activations": {"num_bits": 8, "type": "int"}}}},
        "nvfp4-pack-quantized": {"format": "nvfp4-pack-quantized"},
        "transform_config": {"transform_config": {"config_groups": {"u": {"type": "hadamard"}}}},
        "kv_cache_scheme": {"kv_cache_scheme": {"num_bits": 8, "type": "float"}},
        "strategy 'block'": {"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                                 "strategy": "block"}}}},
        "preset scheme 'NVFP4'": {"config_groups": {"NVFP4": ["Linear"]}},
    }
    for what, change in refused.items():
        with pytest.raises(ValueError, match=what.split("'")[0].strip() or what):
            read_quantization_config({"quantization_config": {**config, **change}})


PRESETS = ["tiny-qwen3-next", "tiny-flash-next", "tiny-qwen3.5-moe"]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_checkpoint_loads_as_the_library_decompresses_it(preset, tmp_path):
    """A synthetic W4A16 checkpoint (flashnext synth --dtype int4-ct: llm-compressor's config and tensor names, per
    expert) dequantises to the library's decompress of every stored weight; a dense projection rewritten in 8 bits
    (mixed precision) loads dequantised too, and layer 1's routed experts rewritten asymmetric by row (channel
    strategy) load packed, with their zero points."""
    folder = synthesize(preset, tmp_path / "ckpt", dtype="int4-ct", seed=7)
    config = json.loads((folder / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    prefix = "model." if preset == "tiny-qwen3-next" else "model.language_model."
    shard = next(folder.glob("*.safetensors"))
    raw = load_file(shard)
    dense = prefix + "layers.3.self_attn.o_proj"
    eight, s8 = compressed(8, False, "group", group, *raw[f"{dense}.weight_shape"].tolist(), seed=8)
    raw.update({f"{dense}.{part}": tensor for part, tensor in eight.items()})
    experts = prefix + "layers.1.mlp.experts"
    asym = {}
    for key in [k for k in raw if k.startswith(experts + ".") and k.endswith(".weight_packed")]:
        base = key.removesuffix(".weight_packed")
        parts, s_asym = compressed(4, False, "channel", 0, *raw[f"{base}.weight_shape"].tolist(), seed=len(asym))
        raw.update({f"{base}.{part}": tensor for part, tensor in parts.items()})
        asym[base] = decompressed(parts, s_asym)
    save_file(raw, str(shard), metadata={"format": "pt"})
    expected = expected_tensors(config)
    ours = load_checkpoint(folder, expected, dtype=torch.float32, progress=False)
    stacked = "model.layers.1.mlp.experts.gate_up_proj"
    packed = load_checkpoint(folder, expected, dtype=torch.float32, progress=False, packed_int4=frozenset([stacked]))
    w = packed[stacked]
    assert w.zeros is not None and w.group_size == expected[stacked][0][-1]
    for e in (0, 3):
        one = dequantize_int4(type(w)(w.qweight[e], w.scales[e], w.zeros[e], None, w.group_size))
        assert torch.equal(one, torch.cat([asym[f"{experts}.{e}.gate_proj"], asym[f"{experts}.{e}.up_proj"]]))
        assert torch.equal(ours[stacked][e], one)

    def want(base, s=scheme(4, True, "group", group)):
        """The library's decompress, in fp32 (it computes in the scales' dtype, bf16 here, where we are exact)."""
        parts = {part: raw[f"{base}.{part}"] for part in ct.PARTS if f"{base}.{part}" in raw}
        return decompressed({**parts, ct.SCALE: parts[ct.SCALE].float()}, s)

    expert = prefix + "layers.0.mlp.experts.1"
    gate_up = ours["model.layers.0.mlp.experts.gate_up_proj"][1]
    assert torch.equal(gate_up, torch.cat([want(expert + ".gate_proj"), want(expert + ".up_proj")]))
    assert torch.equal(ours["model.layers.0.mlp.experts.down_proj"][1], want(expert + ".down_proj"))
    assert torch.equal(ours["model.layers.3.self_attn.o_proj.weight"], want(dense, s8))
    router = prefix + "layers.0.mlp.gate.weight"      # an ignored module: 16-bit, read as it is
    assert raw[router].dtype == torch.bfloat16 and torch.equal(ours["model.layers.0.mlp.gate.weight"], raw[router].float())


def test_unpacked_zero_points_are_refused_by_name(tmp_path):
    """Exports from before compressed-tensors packed zero points store them [N, groups]: refused, not misread."""
    folder = synthesize("tiny-qwen3-next", tmp_path / "ckpt", dtype="int4-ct", seed=10)
    shard = next(folder.glob("*.safetensors"))
    raw = load_file(shard)
    base = next(k for k in raw if k.endswith(".o_proj.weight_packed")).removesuffix(".weight_packed")
    raw[f"{base}.weight_zero_point"] = torch.zeros(raw[f"{base}.weight_scale"].shape, dtype=torch.int8)
    save_file(raw, str(shard), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="is not packed"):
        load_checkpoint(folder, expected_tensors(config), dtype=torch.float32, progress=False)


def test_a_checkpoint_missing_a_part_names_it(tmp_path):
    folder = synthesize("tiny-qwen3-next", tmp_path / "ckpt", dtype="int4-ct", seed=9)
    shard = next(folder.glob("*.safetensors"))
    raw = load_file(shard)
    victim = next(k for k in raw if k.endswith(".weight_scale"))
    del raw[victim]
    save_file(raw, str(shard), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="without its weight_scale"):
        load_checkpoint(folder, expected_tensors(config), dtype=torch.float32, progress=False)


def test_an_fp8_dynamic_checkpoint_loads_as_the_library_decompresses_it(tmp_path, caplog):
    """llm-compressor's FP8 W8A8 layout (fp8 weights with a scale a row, the routed experts one tensor each) loads
    dequantised, as the library decompresses it; a static activation scale is counted as used, not applied, and the
    load says that activations are computed in 16 bits."""
    folder = synthesize("tiny-qwen3-next", tmp_path / "ckpt", dtype="bf16", seed=11)
    shard = next(folder.glob("*.safetensors"))
    raw = load_file(shard)
    fp8 = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float", strategy="channel"))
    stored = {}
    for key in [k for k in raw if k.endswith((".o_proj.weight", ".down_proj.weight"))]:
        weight, base = raw.pop(key).float(), key.removesuffix(".weight")
        out = NaiveQuantizationCompressor.compress(
            {"weight": weight, "weight_scale": weight.abs().amax(1, keepdim=True) / 448}, fp8)
        raw.update({f"{base}.weight": out["weight"], f"{base}.weight_scale": out["weight_scale"],
                    f"{base}.input_scale": torch.ones(1)})
        stored[base] = NaiveQuantizationCompressor.decompress(out, fp8)["weight"]
    save_file(raw, str(shard), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}},
        "ignore": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    with caplog.at_level("INFO", logger="flashnext.weights.checkpoint"):
        ours = load_checkpoint(folder, expected_tensors(config), dtype=torch.float32, progress=False)
    assert "computes them in 16 bits" in caplog.text
    assert any(w.dtype == torch.float8_e4m3fn for w in raw.values())
    assert torch.equal(ours["model.layers.3.self_attn.o_proj.weight"], stored["model.layers.3.self_attn.o_proj"])
    assert torch.equal(ours["model.layers.0.mlp.experts.down_proj"][5],
                       stored["model.layers.0.mlp.experts.5.down_proj"])
    assert torch.equal(ours["model.layers.1.mlp.shared_expert.down_proj.weight"],
                       stored["model.layers.1.mlp.shared_expert.down_proj"])
    from flashnext.engine.loading import load_model
    from flashnext.models.session import Session

    model = load_model(str(folder), "cpu", torch.float32).model
    assert torch.equal(model.get_submodule("model.layers.3.self_attn.o_proj").weight,
                       stored["model.layers.3.self_attn.o_proj"])
    assert torch.isfinite(Session(model, 32).extend([5, 9, 11, 200])).all()


def test_a_misshapen_scale_is_reported_before_reading(tmp_path):
    folder = synthesize("tiny-qwen3-next", tmp_path / "ckpt", dtype="int4-ct", seed=12)
    shard = next(folder.glob("*.safetensors"))
    raw = load_file(shard)
    victim = next(k for k in raw if k.endswith(".o_proj.weight_scale"))
    raw[victim] = raw[victim][:-1]
    save_file(raw, str(shard), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="weight_scale .* does not fit"):
        load_checkpoint(folder, expected_tensors(config), dtype=torch.float32, progress=False)
