"""The oracle: transformers' reference models on tiny random configs, and helpers to compare with them.

Default initialisation zeroes zero-centred norm weights and the PLE conv, which hides bugs, so every
parameter is re-randomised (MODEL.md §4).
"""
from __future__ import annotations

import math

import torch

TINY = {
    "qwen4_exp": dict(
        model_type="qwen4_exp_text", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, hc_count=2, hc_lowrank=16, ple_layer_ids=[2], heads_per_ngram=2,
        ngram_vocab_size_base=1000, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8,
        indexer_compress_ratio=4, eos_token_id=1, output_gate_type="sigmoid", split_ngram_parts=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True}),
    "qwen3_next": dict(
        model_type="qwen3_next", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, intermediate_size=48, eos_token_id=1, decoder_sparse_step=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe_text", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
}


def hf_config(arch: str, **overrides):
    import transformers
    raw = {**TINY[arch], **overrides}
    cls = {"qwen4_exp": transformers.Qwen4ExpTextConfig, "qwen3_next": transformers.Qwen3NextConfig,
           "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig}[arch]
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    return cls(**kwargs), raw


def hf_model(arch: str, seed: int = 0, **overrides):
    """A transformers CausalLM with every parameter re-randomised, fp32, eager attention."""
    import transformers
    config, raw = hf_config(arch, **overrides)
    config._attn_implementation = "eager"
    cls = {"qwen4_exp": transformers.Qwen4ExpForCausalLM, "qwen3_next": transformers.Qwen3NextForCausalLM,
           "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomise(model)
    return model, raw


@torch.no_grad()
def randomise(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(0.01, 2.0).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn_like(p) * 0.5)
        elif "norm" in name and p.ndim == 1:
            p.copy_(torch.randn_like(p) * 0.2)
        elif p.ndim == 1:
            p.copy_(torch.randn_like(p) * 0.2)
        else:
            fan_in = p.shape[-1] if p.ndim >= 2 else 1
            if "conv1d" in name:
                fan_in = p.shape[-1]
            p.copy_(torch.randn_like(p) / math.sqrt(fan_in))


def ours_from_hf(hf, raw: dict, dtype=torch.float32):
    from flashnext.models import build_model
    from flashnext.weights.config import parse_config
    cfg = parse_config(raw)
    model = build_model(cfg, dtype=dtype)
    ours = model.state_dict()
    theirs = hf.state_dict()
    assert set(ours) == set(theirs), (sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours)))
    for k, v in theirs.items():
        if v.dtype == torch.long:
            assert torch.equal(ours[k], v), f"derived buffer {k} differs from transformers'"
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in theirs.items()})
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
