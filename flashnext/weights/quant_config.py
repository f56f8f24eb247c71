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
    weight_block: tuple[int, int] | None = None   # compressed-tensors' block_structure (its block strategy)
    activations_quantised: bool = False           # compressed-tensors W8A8 / W4A8: flashnext computes them in 16 bits
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
        "AutoRound or GPTQ int4 (auto_gptq packing), compressed-tensors (int4/int8/fp8 weights) and block-FP8 "
        "checkpoints"
    )


# compressed-tensors' preset schemes that a config group may name instead of spelling out: (type, bits, symmetric)
# (the group sizes are the presets', and only informational: the loader reads a weight's groups off its scales)
_CT_PRESETS = {"W4A16": ("int", 4, True, 128), "W4A16_ASYM": ("int", 4, False, 128), "W8A16": ("int", 8, True, 128),
               "W4A8": ("int", 4, True, 128), "W8A8": ("int", 8, True, None), "INT8": ("int", 8, True, None),
               "FP8": ("float", 8, True, None), "FP8_DYNAMIC": ("float", 8, True, None),
               "FP8_BLOCK": ("float", 8, True, None)}
_CT_FORMATS = ("pack-quantized", "float-quantized", "int-quantized", "naive-quantized")


def _compressed_tensors(qc: dict) -> QuantizationConfig:
    """compressed-tensors (weights/compressed_tensors.py): integer weights of 4 or 8 bits packed (pack-quantized) and
    8-bit integer or fp8 weights unpacked (int-/float-/naive-quantized), whatever their activations' scheme — the
    activations are computed in 16 bits, as vLLM does on GPUs without FP8; FP4 and MX formats, output activation
    quantisation, sparsity and a quantised KV cache are refused."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"compressed-tensors {what} is not supported; flashnext loads 4- and 8-bit integer weights "
                          f"and fp8 weights ({', '.join(_CT_FORMATS)})")

    formats, schemes, block, activations = {qc.get("format")}, [], None, False
    for name, group in (qc.get("config_groups") or {}).items():
        if isinstance(group, list):            # a preset's name with its targets
            if name not in _CT_PRESETS:
                raise refuse(f"preset scheme {name!r}")
            schemes.append(_CT_PRESETS[name])
            block = (128, 128) if name == "FP8_BLOCK" else block
            activations |= "A16" not in name
            continue
        weights = group.get("weights") or {}
        kind, bits = weights.get("type", "int"), weights.get("num_bits")
        if group.get("output_activations"):
            raise refuse(f"output activation quantisation (config group {name!r})")
        if not ((kind == "int" and bits in (4, 8)) or (kind == "float" and bits == 8)) or weights.get("dynamic"):
            raise refuse(f"weight scheme {kind}{bits}{' dynamic' if weights.get('dynamic') else ''} "
                         f"(config group {name!r})")
        strategy = weights.get("strategy")
        # integers as the pack-quantized compressor stores them (scales by row or by group along the inputs)
        if strategy not in (("tensor", "channel", "group", "block") if kind == "float" else ("channel", "group")):
            raise refuse(f"weight strategy {strategy!r} for {kind} weights (config group {name!r})")
        if strategy == "block":
            block = tuple(int(b) for b in weights.get("block_structure") or (128, 128))
        formats.add(group.get("format") or qc.get("format"))
        activations |= bool(group.get("input_activations"))
        schemes.append((kind, bits, bool(weights.get("symmetric", True)),
                        weights.get("group_size") if strategy == "group" else None))
    # "mixed-precision" at the top: each group names its own format, checked above
    formats.discard(None)
    formats.discard("mixed-precision")
    if formats - set(_CT_FORMATS):
        raise refuse(f"format {sorted(formats - set(_CT_FORMATS))}")
    if not schemes:
        raise refuse("config without config_groups")
    if qc.get("kv_cache_scheme"):
        raise refuse("kv_cache_scheme (a quantised KV cache)")
    if qc.get("transform_config"):
        raise refuse("transform_config (online rotations: QuIP, SpinQuant)")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise refuse(f"sparsity format {sparsity.get('format')!r}")
    group_sizes = {g for *_, g in schemes if g}
    return QuantizationConfig(method="compressed-tensors", bits=max(bits for _, bits, _, _ in schemes),
                              group_size=min(group_sizes) if group_sizes else None,
                              sym=all(sym for _, _, sym, _ in schemes), weight_block=block,
                              activations_quantised=activations)
