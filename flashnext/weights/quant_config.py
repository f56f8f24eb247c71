"""The `quantization_config` of a checkpoint's config.json, reduced to what loading needs."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .checkpoint_keys import canonical_name

# AutoRound packings whose int4 tensors follow auto_gptq (zero points stored minus one).
_GPTQ_V1_PACKINGS = {None, "auto_gptq", "auto_round:auto_gptq", "auto_round:gptq"}


@dataclass(frozen=True)
class QuantizationConfig:
    method: str | None = None  # None (16-bit), "auto-round", "gptq" or "fp8"
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
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 format {qc.get('fmt')!r} is not supported; flashnext loads e4m3 block-FP8")
        block = qc.get("weight_block_size") or (128, 128)
        return QuantizationConfig(method="fp8", bits=8, fp8_block=(int(block[0]), int(block[1])))
    raise ValueError(
        f"quantization method {qc.get('quant_method')!r} is not supported; flashnext loads bf16/fp16/fp32, "
        "AutoRound or GPTQ int4 (auto_gptq packing) and block-FP8 checkpoints"
    )
