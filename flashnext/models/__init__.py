"""Architectures by model_type, and the one way to build a model."""
import torch

from flashnext.weights.config import ModelConfig


def model_class(arch: str):
    # Imported lazily so `flashnext --help` stays fast.
    if arch == "qwen4_exp":
        from flashnext.models.qwen4_exp import Qwen4ExpForCausalLM
        return Qwen4ExpForCausalLM
    if arch == "qwen3_next":
        from flashnext.models.qwen3_next import Qwen3NextForCausalLM
        return Qwen3NextForCausalLM
    if arch == "qwen3_5_moe":
        from flashnext.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
        return Qwen3_5MoeForCausalLM
    raise ValueError(f"unsupported architecture {arch!r}")


def build_model(cfg: ModelConfig, device="cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """An uninitialised model whose state_dict keys equal transformers' CausalLM keys (docs/CONTRACTS.md)."""
    with torch.device(device):
        model = model_class(cfg.arch)(cfg)
    # Buffers of integer type (PLE hash constants) keep their dtype; everything float takes `dtype`.
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)
