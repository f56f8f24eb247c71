"""Physical floors of PERF.md that the report sets beside each measured rate (one H200, INT4 weights)."""
from __future__ import annotations

# Batch-1 decode: weight bytes per token at 4.27 TB/s; prefill: matmul FLOPs at 780 TFLOP/s.
FLOORS: dict[str, dict[str, float]] = {
    "flash-next": {"decode": 775.0, "prefill": 58_000.0},    # INT4 experts + dense, bf16 HC/router/lm_head
    "qwen3-next-80b": {"decode": 1_790.0},                    # INT4 g128 linears, bf16 lm_head
}
# Names a model id or preset may carry for each floor key.
_ALIASES = {"flash-next": ("flash-next", "flashnext", "flash_next", "qwen4exp", "qwen4_exp", "qwen3.8-flash"),
            "qwen3-next-80b": ("qwen3-next-80b", "qwen3_next_80b", "qwen3-next")}


def floor_key(result: dict) -> str | None:
    """The floor that applies to a result: --floor if given, else guessed from the model's names.

    A tiny test model shares its architecture's name but not its size, so it gets no floor.
    """
    flags = result.get("flags", {})
    if flags.get("floor"):
        return flags["floor"] if flags["floor"] in FLOORS else None
    names = " ".join(str(x) for x in (result.get("model_id"), flags.get("model"), flags.get("model_name")) if x)
    names = names.lower()
    if "tiny" in names:
        return None
    for key, aliases in _ALIASES.items():
        if any(a in names for a in aliases):
            return key
    return None


def floor_for(result: dict, kind: str) -> float | None:
    key = floor_key(result)
    return FLOORS[key].get(kind) if key else None
