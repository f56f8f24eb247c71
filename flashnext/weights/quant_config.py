"""The `quantization_config` of a checkpoint's config.json, reduced to what loading needs."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .checkpoint_keys import canonical_name

# AutoRound packings whose int4 tensors follow auto_gptq (zero points stored minus one).
_GPTQ_V1_PACKINGS = {None, "auto_gptq", "auto_round:auto_gptq", "auto_round:gptq"}


@dataclass(frozen=True)
class QuantizationConfig:
    method: str | None = None  # None (16-bit), "auto-round", "gptq", "fp8" or "compressed-tensors"
    bits: int = 16
    group_size: int | None = None
    sym: bool = True
    zeros_minus_one: bool = True  # gptq v1 zero points
    fp8_block: tuple[int, int] = (128, 128)
    asymmetric_modules: tuple[str, ...] = field(default_factory=tuple)   # extra_config's "sym": false overrides

    def symmetric(self, module: str) -> bool:
        """Whether `module` (a checkpoint name without .qweight) is declared symmetric: `sym`, unless extra_config
        overrides it for that module (named with or without a multimodal checkpoint's language_model prefix)."""
        return self.sym and canonical_name(module) not in self._asymmetric

    @functools.cached_property
    def _asymmetric(self) -> frozenset[str]:
        return frozenset(canonical_name(m) for m in self.asymmetric_modules)


def read_quantization_config(config: dict) -> QuantizationConfig:
    """Parse config.json's quantization_config (top level or inside text_config); raise on formats we cannot load."""
    qc = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if not qc:
        return QuantizationConfig()
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method in ("auto-round", "autoround", "gptq"):
        packing = qc.get("packing_format")
        if method != "gptq" and packing not in _GPTQ_V1_PACKINGS:
            raise ValueError(
                f"AutoRound packing format {packing!r} is not supported; flashnext loads auto_gptq-packed "
                "AutoRound checkpoints (packing_format 'auto_round:auto_gptq')"
            )
        extra = qc.get("extra_config") or {}
        return QuantizationConfig(
            method="gptq" if method == "gptq" else "auto-round",
            bits=int(qc.get("bits", 4)),
            group_size=qc.get("group_size"),
            sym=bool(qc.get("sym", True)),
            zeros_minus_one=qc.get("checkpoint_format", "gptq") != "gptq_v2",
            asymmetric_modules=tuple(name for name, override in extra.items() if override.get("sym") is False),
        )
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 format {qc.get('fmt')!r} is not supported; flashnext loads e4m3 block-FP8")
        block = qc.get("weight_block_size") or (128, 128)
        return QuantizationConfig(method="fp8", bits=8, fp8_block=(int(block[0]), int(block[1])))
    raise ValueError(
        f"quantization method {qc.get('quant_method')!r} is not supported; flashnext loads bf16/fp16/fp32, "
        "AutoRound or GPTQ int4 (auto_gptq packing), compressed-tensors W4A16/W8A16 (pack-quantized) and block-FP8 "
        "checkpoints"
    )


# compressed-tensors' preset schemes that a config group may name instead of spelling out (weight-only integers)
_CT_PRESETS = {"W4A16": (4, True), "W4A16_ASYM": (4, False), "W8A16": (8, True)}


def _compressed_tensors(qc: dict) -> QuantizationConfig:
    """compressed-tensors: weight-only integer groups in the pack-quantized format (weights/compressed_tensors.py);
    every other scheme (activation quantisation, FP8/FP4 formats, sparsity, a quantised KV cache) is refused."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"compressed-tensors {what} is not supported; flashnext loads its weight-only integer "
                          "schemes (W4A16, W8A16, asymmetric or not) in the pack-quantized format")

    formats = {qc.get("format")}
    schemes = []
    for name, group in (qc.get("config_groups") or {}).items():
        if isinstance(group, list):            # a preset's name with its targets
            if name not in _CT_PRESETS:
                raise refuse(f"preset scheme {name!r}")
            schemes.append(_CT_PRESETS[name] + (None, 128))
            continue
        weights = group.get("weights") or {}
        if group.get("input_activations") or group.get("output_activations"):
            raise refuse(f"activation quantisation (config group {name!r})")
        if weights.get("type", "int") != "int" or weights.get("num_bits") not in (4, 8) or weights.get("dynamic"):
            raise refuse(f"weight scheme {weights.get('type')}{weights.get('num_bits')} (config group {name!r})")
        if weights.get("strategy") not in ("group", "channel"):
            raise refuse(f"weight strategy {weights.get('strategy')!r} (config group {name!r})")
        formats.add(group.get("format") or qc.get("format"))
        schemes.append((weights["num_bits"], bool(weights.get("symmetric", True)), weights.get("strategy"),
                        weights.get("group_size")))
    formats.discard(None)
    if formats - {"pack-quantized"}:
        raise refuse(f"format {sorted(formats - {'pack-quantized'})}")
    if not schemes:
        raise refuse("config without config_groups")
    if qc.get("kv_cache_scheme"):
        raise refuse("kv_cache_scheme (a quantised KV cache)")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise refuse(f"sparsity format {sparsity.get('format')!r}")
    group_sizes = {g for _, _, strategy, g in schemes if strategy != "channel"}
    return QuantizationConfig(method="compressed-tensors", bits=max(bits for bits, *_ in schemes),
                              group_size=min(group_sizes) if group_sizes else None,
                              sym=all(sym for _, sym, _, _ in schemes))
