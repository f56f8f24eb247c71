"""Typed model configuration parsed from a Hugging Face config.json.

One dataclass covers the three architectures; fields a family lacks keep neutral defaults. Every
unsupported or inconsistent setting fails here, at load, with a message that names the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("qwen4_exp", "qwen3_next", "qwen3_5_moe")
_TEXT_TYPES = {"qwen4_exp_text": "qwen4_exp", "qwen3_5_moe_text": "qwen3_5_moe"}


class ConfigError(ValueError):
    def __init__(self, field_name: str, message: str):
        super().__init__(f"config.json: {field_name}: {message}")
        self.field = field_name


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: list[str]            # "linear_attention" | "full_attention" | "indexed_attention"
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    hidden_act: str
    # GatedDeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel: int
    gdn_output_gate: str              # activation on the gated RMSNorm's gate: "silu" | "sigmoid"
    # MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    dense_intermediate_size: int = 0  # qwen3_next layers that are not sparse
    sparse_layers: list[bool] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Flash-Next only: hyper-connections, PLE and the QSA indexer
    hc_count: int = 1
    hc_lowrank: int = 0
    ple_layers: list[int] = field(default_factory=list)   # zero-indexed
    ple_embed_dim: int = 0
    ple_conv_kernel: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 0
    ngram_vocab_size_base: int = 0
    ngram_vocab_divisible_by: int = 128
    ngram_seed: int = 1234
    split_ngram_parts: int = 1
    indexer_heads: int = 0
    indexer_head_dim: int = 0
    indexer_budget: int = 0
    indexer_compress_ratio: int = 0
    torch_dtype: str = "bfloat16"
    quantization: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def hc_hidden_size(self) -> int:
        return self.hidden_size * self.hc_count

    @property
    def uses_hyper_connections(self) -> bool:
        return self.arch == "qwen4_exp"

    @property
    def gdn_split_projections(self) -> bool:
        """qwen3_next fuses q/k/v/z and b/a per key-head group; the newer families keep them apart."""
        return self.arch != "qwen3_next"

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != "linear_attention"]

    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError("config.json", f"not found at {file}") from None
    except json.JSONDecodeError as e:
        raise ConfigError("config.json", f"is not valid JSON ({e})") from None
    return parse_config(raw)


def _eos_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    text = raw
    if model_type in ("qwen4_exp", "qwen3_5_moe") and "text_config" in raw:
        text = dict(raw["text_config"])
    elif model_type in _TEXT_TYPES:
        model_type = _TEXT_TYPES[model_type]
    if model_type not in SUPPORTED_ARCHS:
        raise ConfigError("model_type", f"{model_type!r} is not supported; flashnext serves {', '.join(SUPPORTED_ARCHS)}")

    def get(name, default=None, *, required=False):
        if name in text:
            return text[name]
        if name in raw:
            return raw[name]
        if required:
            raise ConfigError(name, "is required and missing")
        return default

    num_layers = int(get("num_hidden_layers", required=True))
    layer_types = get("layer_types")
    if layer_types is None:
        interval = int(get("full_attention_interval", 4))
        attn = "indexed_attention" if model_type == "qwen4_exp" else "full_attention"
        layer_types = ["linear_attention" if (i + 1) % interval else attn for i in range(num_layers)]
    layer_types = list(layer_types)[:num_layers]
    if len(layer_types) != num_layers:
        raise ConfigError("layer_types", f"has {len(layer_types)} entries for {num_layers} layers")
    if model_type == "qwen4_exp":
        # The released checkpoint writes "full_attention" for layers that actually use the QSA indexer.
        layer_types = ["indexed_attention" if t == "full_attention" else t for t in layer_types]
    allowed = {"linear_attention", "indexed_attention"} if model_type == "qwen4_exp" else {"linear_attention", "full_attention"}
    bad = sorted(set(layer_types) - allowed)
    if bad:
        raise ConfigError("layer_types", f"unsupported layer types {bad} for {model_type}")

    rope = get("rope_parameters") or get("rope_scaling") or {}
    rope_theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError("rope_parameters.rope_type", f"{rope_type!r} is not supported (only default RoPE)")
    partial = float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0)))

    hidden = int(get("hidden_size", required=True))
    heads = int(get("num_attention_heads", required=True))
    head_dim = int(get("head_dim") or hidden // heads)
    hidden_act = get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError("hidden_act", f"{hidden_act!r} is not supported (silu only)")
    gate = get("output_gate_type") or hidden_act if model_type == "qwen4_exp" else "silu"
    if gate not in ("silu", "sigmoid"):
        raise ConfigError("output_gate_type", f"{gate!r} is not supported (silu or sigmoid)")

    num_experts = int(get("num_experts", 0))
    mlp_only = set(get("mlp_only_layers", []) or [])
    sparse_step = int(get("decoder_sparse_step", 1))
    sparse = [(i not in mlp_only) and num_experts > 0 and (i + 1) % sparse_step == 0 for i in range(num_layers)]
    if model_type != "qwen3_next" and not all(sparse):
        raise ConfigError("num_experts", f"{model_type} needs every layer to be sparse MoE")

    eos = _eos_list(get("eos_token_id"))
    cfg = ModelConfig(
        arch=model_type,
        vocab_size=int(get("vocab_size", required=True)),
        hidden_size=hidden,
        num_layers=num_layers,
        layer_types=layer_types,
        num_attention_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        max_position_embeddings=int(get("max_position_embeddings", 32768)),
        hidden_act=hidden_act,
        linear_num_key_heads=int(get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(get("linear_value_head_dim", 128)),
        linear_conv_kernel=int(get("linear_conv_kernel_dim", 4)),
        gdn_output_gate=gate,
        num_experts=num_experts,
        num_experts_per_tok=int(get("num_experts_per_tok", 1)),
        moe_intermediate_size=int(get("moe_intermediate_size", 0)),
        shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0)),
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        dense_intermediate_size=int(get("intermediate_size", 0) or 0),
        sparse_layers=sparse,
        eos_token_ids=eos,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        attention_bias=bool(get("attention_bias", False)),
        torch_dtype=str(get("dtype") or get("torch_dtype") or "bfloat16"),
        quantization=raw.get("quantization_config") or text.get("quantization_config"),
        raw=raw,
    )
    if model_type == "qwen4_exp":
        _parse_flash_next(cfg, get)
    _validate(cfg)
    return cfg


def _parse_flash_next(cfg: ModelConfig, get) -> None:
    cfg.hc_count = int(get("hc_count", 4))
    cfg.hc_lowrank = int(get("hc_lowrank", 320))
    ple_ids = sorted(set(get("ple_layer_ids") or []))
    bad = [i for i in ple_ids if not 1 <= i <= cfg.num_layers]
    if bad:
        raise ConfigError("ple_layer_ids", f"one-indexed ids must lie in [1, {cfg.num_layers}], got {bad}")
    cfg.ple_layers = [i - 1 for i in ple_ids]
    cfg.ple_embed_dim = int(get("ple_embed_dim") or cfg.hidden_size)
    cfg.ple_conv_kernel = int(get("ple_conv_kernel_size", 4))
    cfg.ngram_size = int(get("ngram_size", 3))
    cfg.heads_per_ngram = int(get("heads_per_ngram", 8))
    cfg.ngram_vocab_size_base = int(get("ngram_vocab_size_base", 20_000_000))
    cfg.ngram_vocab_divisible_by = int(get("make_ngram_vocab_size_divisible_by", 128))
    cfg.ngram_seed = int(get("seed", 1234))
    cfg.split_ngram_parts = int(get("split_ngram_parts", 512))
    fields = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    values = {f: get(f) for f in fields}
    missing = [f for f, v in values.items() if v is None]
    if missing:
        raise ConfigError(missing[0], "is required: flashnext runs qwen4_exp attention with the QSA indexer")
    if int(values["indexer_kv_heads"]) != 1:
        raise ConfigError("indexer_kv_heads", f"must be 1, got {values['indexer_kv_heads']}")
    cfg.indexer_heads = int(values["indexer_n_heads"])
    cfg.indexer_head_dim = int(values["indexer_head_dim"])
    cfg.indexer_budget = int(values["indexer_budget"])
    cfg.indexer_compress_ratio = int(values["indexer_compress_ratio"])


def _validate(cfg: ModelConfig) -> None:
    positive = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "max_position_embeddings")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(name, f"must be positive, got {getattr(cfg, name)}")
    if cfg.num_attention_heads % cfg.num_kv_heads:
        raise ConfigError("num_key_value_heads", f"{cfg.num_kv_heads} does not divide num_attention_heads {cfg.num_attention_heads}")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError("linear_num_value_heads", f"{cfg.linear_num_value_heads} is not a multiple of linear_num_key_heads {cfg.linear_num_key_heads}")
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ConfigError("num_experts_per_tok", f"must lie in [1, num_experts={cfg.num_experts}], got {cfg.num_experts_per_tok}")
    if not 0.0 < cfg.partial_rotary_factor <= 1.0 or cfg.rotary_dim % 2:
        raise ConfigError("partial_rotary_factor", f"gives an odd or empty rotary dimension ({cfg.rotary_dim})")
    if not cfg.eos_token_ids:
        raise ConfigError("eos_token_id", "is required (generation must know where to stop)")
    if any(not 0 <= e < cfg.vocab_size for e in cfg.eos_token_ids):
        raise ConfigError("eos_token_id", f"{cfg.eos_token_ids} lies outside the vocabulary of {cfg.vocab_size}")
    if cfg.arch == "qwen4_exp":
        if cfg.hc_count <= 1:
            raise ConfigError("hc_count", f"must be > 1, got {cfg.hc_count}")
        if cfg.indexer_budget % cfg.indexer_compress_ratio:
            raise ConfigError("indexer_budget", f"{cfg.indexer_budget} is not divisible by indexer_compress_ratio {cfg.indexer_compress_ratio}")
        if cfg.rotary_dim > cfg.indexer_head_dim:
            raise ConfigError("indexer_head_dim", f"{cfg.indexer_head_dim} is smaller than the rotary dimension {cfg.rotary_dim}")
        heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
        if cfg.ple_layers and (heads <= 0 or cfg.ple_embed_dim % heads):
            raise ConfigError("ple_embed_dim", f"{cfg.ple_embed_dim} is not divisible by the {heads} n-gram heads")
        for i in cfg.ple_layers:
            if cfg.layer_types[i] != "linear_attention":
                raise ConfigError("ple_layer_ids", f"PLE on layer {i + 1} needs a linear_attention layer")
    if cfg.quantization:   # the loader's own parse, so a format it cannot load is refused before any weight is read
        from flashnext.weights.quant_config import read_quantization_config

        try:
            read_quantization_config({"quantization_config": cfg.quantization})
        except ValueError as exc:
            raise ConfigError("quantization_config", str(exc)) from None
