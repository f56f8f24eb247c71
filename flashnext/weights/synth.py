"""Random-weight checkpoints with the real layouts, for tests and benchmarks without downloading a model.

`synthesize` writes a Hugging Face folder (config, sharded safetensors in the architecture's *checkpoint* layout,
tokenizer, generation config) that transformers and `load_checkpoint` both load; `synthesize_state_dict` makes
the same values straight in memory under our canonical keys. Every tensor draws from its own generator seeded by
(seed, name), so both paths, and any subset of tensors, give identical values.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import compressed_tensors
from .checkpoint import INDEX_FILE, _EXPERT_KEY
from .fp8 import dequantize_block_fp8, quantize_block_fp8
from .int4 import dequantize_gptq, quantize_gptq_rtn
from .presets import PRESETS, generation_config, get_preset, set_num_layers, special_token_ids

# int4: AutoRound (auto_gptq packing); int4-ct: compressed-tensors pack-quantized W4A16 (llm-compressor's format)
KINDS = ("bf16", "int4", "int4-ct", "fp8")
SHARD_BYTES = 2 * 1024**3
_CHUNK = 1 << 24  # elements drawn per randn call: bounds the fp32 temporary for huge tensors
# Dense projections and routed experts are quantised; embeddings, lm_head, router, shared_expert_gate,
# in_proj_b/a, norms, convs, GDN decay parameters, hyper-connections, PLE and the indexer stay 16-bit.
_QUANTISED = re.compile(
    r"(\.experts\.(gate_up_proj|down_proj)"
    r"|\.linear_attn\.(in_proj_qkv|in_proj_qkvz|in_proj_z|out_proj)\.weight"
    r"|\.self_attn\.[qkvo]_proj\.weight"
    r"|\.shared_expert\.(gate|up|down)_proj\.weight)$"
)
_PLE_BUFFER = re.compile(r"^model\.layers\.(\d+)\.ple\.ple_embedding\.(layer_multipliers|ngram_heads_vocab_sizes"
                         r"|ngram_heads_offsets)$")


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def arch_of(config: dict) -> str:
    model_type = config.get("model_type", "")
    arch = model_type.removesuffix("_text")
    if arch not in ("qwen4_exp", "qwen3_next", "qwen3_5_moe"):
        raise ValueError(f"cannot synthesise model_type {model_type!r}")
    return arch


def expected_tensors(config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of our model for `config`, listed on the meta device."""
    from flashnext.models import build_model
    from flashnext.weights.config import parse_config

    model = build_model(parse_config(config), device="meta")
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


# ---- PLE hash constants: the model derives them; the checkpoint ships a copy -------------------------------
def ple_buffers(text_config: dict, ple_layer_index: int) -> dict[str, torch.Tensor]:
    """layer_multipliers, ngram_heads_vocab_sizes, ngram_heads_offsets of the `ple_layer_index`-th PLE layer."""
    from flashnext.models.layers.ple import ngram_head_sizes, ngram_multipliers

    ngram_size = text_config.get("ngram_size", 3)
    heads = (ngram_size - 1) * text_config.get("heads_per_ngram", 8)
    multipliers = ngram_multipliers(text_config["vocab_size"], ngram_size, ple_layer_index, text_config.get("seed", 1234))
    sizes = ngram_head_sizes(text_config.get("ngram_vocab_size_base", 20_000_000), heads, ple_layer_index)
    offsets = [sum(sizes[:i]) for i in range(heads)]
    return {"layer_multipliers": torch.tensor(multipliers), "ngram_heads_vocab_sizes": torch.tensor(sizes),
            "ngram_heads_offsets": torch.tensor(offsets)}


# ---- random values -----------------------------------------------------------------------------------------
def _init(name: str, shape: tuple[int, ...]) -> tuple[str, float, float]:
    """(distribution, a, b) for one float tensor: ("normal", mean, std) or ("log_uniform", low, high)."""
    if name.endswith("linear_attn.A_log"):
        # A = U(0.01, 2) rather than transformers' U(0.01, 16): with 16 most heads forget almost everything each
        # step (exp(-A * softplus)), so long-context bugs in the recurrent state would go unnoticed.
        return "log_uniform", 0.01, 2.0
    if name.endswith("linear_attn.dt_bias"):
        return "normal", 0.0, 1.0
    if name.endswith("linear_attn.norm.weight"):  # the gated GDN norm multiplies by w itself
        return "normal", 1.0, 0.2
    if len(shape) == 1 and "norm" in name:  # zero-centred norms multiply by 1 + w
        return "normal", 0.0, 0.2
    if name.endswith("conv1d.weight"):  # depthwise [C, 1, k]
        return "normal", 0.0, 1 / math.sqrt(shape[-1])
    if name.endswith(("embed_tokens.weight", "ngram_embedding.weight")):
        return "normal", 0.0, 1.0
    if len(shape) in (2, 3):  # [out, in] or experts [E, out, in]: activations keep their scale layer after layer
        return "normal", 0.0, 1 / math.sqrt(shape[-1])
    raise ValueError(f"no initialisation rule for tensor {name} {shape}")


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))
    return generator


def random_tensor(name: str, shape: tuple[int, ...], *, seed: int, dtype: torch.dtype,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """The synthetic value of float tensor `name`, filled in chunks so a huge table needs no fp32 copy."""
    device = torch.device(device)
    kind, a, b = _init(name, shape)
    generator = _generator(seed, name, device)
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - start)
        if kind == "normal":
            flat[start: start + n] = torch.randn(n, generator=generator, device=device) * b + a
        else:
            flat[start: start + n] = torch.rand(n, generator=generator, device=device).mul_(b - a).add_(a).log_()
    return out


# ---- quantisation of one canonical tensor into checkpoint pieces ----------------------------------------------
def is_quantised(name: str) -> bool:
    return _QUANTISED.search(name) is not None


def int4_group_size(expected: dict) -> int:
    """128, or the largest power of two below it dividing the input size of every quantised weight."""
    group = 128
    while any(shape[-1] % group for name, (shape, _) in expected.items() if is_quantised(name)):
        group //= 2
    return group


def _pieces(name: str, weight: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A quantised tensor as the 2-D weights a quantised checkpoint stores (experts one by one)."""
    match = _EXPERT_KEY.match(name)
    if not match:
        return [(name, weight)]
    prefix, kind = match.groups()
    if kind == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", weight[e]) for e in range(weight.shape[0])]
    half = weight.shape[1] // 2
    return [(f"{prefix}.{e}.{proj}.weight", weight[e, rows]) for e in range(weight.shape[0])
            for proj, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None)))]


def _quantise(name: str, weight: torch.Tensor, kind: str, group: int) -> dict[str, torch.Tensor]:
    base = name.removesuffix(".weight")
    if kind == "int4":
        return {f"{base}.{k}": v for k, v in quantize_gptq_rtn(weight, group_size=group).items()}
    if kind == "int4-ct":
        return {f"{base}.{k}": v for k, v in compressed_tensors.quantize_rtn(weight, group_size=group).items()}
    q, scale = quantize_block_fp8(weight)
    return {name: q, name + "_scale_inv": scale}


def _dequantise(packed: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    if kind == "int4":
        qweight, qzeros, scales = (next(v for k, v in packed.items() if k.endswith(s))
                                   for s in (".qweight", ".qzeros", ".scales"))
        return dequantize_gptq(qweight, qzeros, scales)
    if kind == "int4-ct":
        return compressed_tensors.dequantize({k.rsplit(".", 1)[1]: v for k, v in packed.items()}, 4)
    weight, scale = packed.values()
    return dequantize_block_fp8(weight, scale)


def _value(name, shape, dtype, *, config, seed, device, out_dtype) -> torch.Tensor:
    ple = _PLE_BUFFER.match(name)
    if ple:
        text = _text(config)
        index = text["ple_layer_ids"].index(int(ple.group(1)) + 1)
        return ple_buffers(text, index)[ple.group(2)].to(dtype=dtype, device=device)
    if not dtype.is_floating_point:
        raise ValueError(f"no synthetic value for integer tensor {name}")
    return random_tensor(name, shape, seed=seed, dtype=out_dtype, device=device)


def synthesize_state_dict(
    config: dict | str,
    dtype: str = "bf16",
    seed: int = 0,
    device: str | torch.device = "cpu",
    *,
    expected: dict | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """Canonical-key weights of a synthetic checkpoint of kind `dtype`, made in memory (quantised kinds come
    back dequantised, as `load_checkpoint` returns them). Generated one tensor at a time."""
    config = get_preset(config) if isinstance(config, str) else config
    if dtype not in KINDS:
        raise ValueError(f"dtype must be one of {KINDS}, got {dtype!r}")
    expected = expected_tensors(config) if expected is None else expected
    group = int4_group_size(expected)
    result = {}
    for name, (shape, tensor_dtype) in expected.items():
        if dtype == "bf16" or not is_quantised(name):
            result[name] = _value(name, shape, tensor_dtype, config=config, seed=seed, device=device,
                                  out_dtype=out_dtype)
            continue
        weight = random_tensor(name, shape, seed=seed, dtype=torch.float32, device=device)
        for piece_name, piece in _pieces(name, weight):
            piece.copy_(_dequantise(_quantise(piece_name, piece, dtype, group), dtype))
        result[name] = weight.to(out_dtype)
    return result


class _ShardWriter:
    def __init__(self, out_dir: Path, shard_bytes: int):
        self.out_dir, self.shard_bytes = out_dir, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []

    def add(self, key: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self.flush()
        self.pending[key] = tensor.contiguous().clone() if tensor._base is not None else tensor.contiguous()
        self.pending_bytes += size

    def flush(self) -> None:
        if self.pending:
            save_file(self.pending, str(self.out_dir / f"part-{len(self.files)}.safetensors"), {"format": "pt"})
            self.files.append(list(self.pending))
            self.pending, self.pending_bytes = {}, 0

    def finish(self, total_bytes: int) -> None:
        self.flush()
        weight_map = {}
        for i, keys in enumerate(self.files):
            name = f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors"
            (self.out_dir / f"part-{i}.safetensors").rename(self.out_dir / name)
            weight_map.update({key: name for key in keys})
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _quantization_config(kind: str, group: int, kept: list[str]) -> dict:
    if kind == "int4-ct":   # as llm-compressor writes a W4A16 (GPTQ or AWQ) export
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                              "output_activations": None,
                                              "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                          "strategy": "group", "group_size": group,
                                                          "dynamic": False, "actorder": None, "observer": "minmax"}}},
                "ignore": kept, "kv_cache_scheme": None}
    if kind == "int4":
        return {"quant_method": "auto-round", "bits": 4, "group_size": group, "sym": True, "data_type": "int",
                "packing_format": "auto_round:auto_gptq",
                "extra_config": {module: {"bits": 16, "data_type": "float"} for module in kept}}
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": kept}


def synthesize(
    preset_or_config: str | dict,
    out_dir: str | Path,
    *,
    dtype: str = "bf16",
    layers: int | None = None,
    seed: int = 0,
    expected: dict | None = None,
    tool_format: str | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write a random-weight checkpoint folder of kind `dtype` (KINDS) and return its path."""
    if dtype not in KINDS:
        raise ValueError(f"dtype must be one of {KINDS}, got {dtype!r}")
    config = get_preset(preset_or_config) if isinstance(preset_or_config, str) else json.loads(
        json.dumps(preset_or_config))
    if layers is not None:
        set_num_layers(config, layers)
    arch = arch_of(config)
    expected = expected_tensors(config) if expected is None else expected
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = "model.language_model." if "text_config" in config else "model."
    group = int4_group_size(expected)
    writer, total, kept = _ShardWriter(out, shard_bytes), 0, []

    def write(canonical: str, tensor: torch.Tensor) -> None:
        nonlocal total
        key = prefix + canonical[len("model."):] if canonical.startswith("model.") else canonical
        writer.add(key, tensor)
        total += tensor.numel() * tensor.element_size()

    for name, (shape, tensor_dtype) in expected.items():
        if dtype != "bf16" and is_quantised(name):
            weight = random_tensor(name, shape, seed=seed, dtype=torch.float32)
            for piece_name, piece in _pieces(name, weight):
                for key, tensor in _quantise(piece_name, piece, dtype, group).items():
                    write(key, tensor)
            continue
        if name.endswith(".weight") and len(shape) == 2 and "ngram_embedding" not in name:
            kept.append((prefix + name[len("model."):] if name.startswith("model.") else name).removesuffix(".weight"))
        value = _value(name, shape, tensor_dtype, config=config, seed=seed, device="cpu", out_dtype=torch.bfloat16)
        match = _EXPERT_KEY.match(name)
        if match and arch == "qwen3_next":  # Qwen3-Next checkpoints store one tensor per expert
            for piece_name, piece in _pieces(name, value):
                write(piece_name, piece)
        elif name.endswith("ngram_embedding.weight"):  # the PLE table ships in split_ngram_parts row shards
            parts = _text(config)["split_ngram_parts"]
            if shape[0] % parts:
                raise ValueError(f"{name} has {shape[0]} rows, not divisible into {parts} shards")
            for i, shard in enumerate(value.chunk(parts)):
                write(name.replace("ngram_embedding.weight", f"ngram_embedding.shard_{i}.weight"), shard)
        else:
            write(name, value)
    writer.finish(total)

    if dtype != "bf16":
        config["quantization_config"] = _quantization_config(dtype, group, kept)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2) + "\n")
    _write_tokenizer(out, config, tool_format or ("hermes" if arch == "qwen3_next" else "qwen3_coder"))
    return out


def _write_tokenizer(out: Path, config: dict, tool_format: str) -> None:
    from flashnext.tokenizer.synthetic import write_tokenizer_files

    wanted = special_token_ids(config)
    got = write_tokenizer_files(out, vocab_size=_text(config)["vocab_size"], tool_format=tool_format,
                                special_token_ids={"<|endoftext|>": wanted["<|endoftext|>"]})
    if any(got[token] != token_id for token, token_id in wanted.items()):
        raise ValueError(f"tokenizer placed the special tokens at {got}, but config.json expects {wanted}")


__all__ = ["KINDS", "PRESETS", "expected_tensors", "ple_buffers", "random_tensor", "synthesize",
           "synthesize_state_dict"]
