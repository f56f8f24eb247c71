"""HF `config.json` dicts of the supported models, written the way the real releases write them.

Full-size presets carry the released hyper-parameters; the tiny ones (MODEL.md §4) exercise every code path in
well under a second on a CPU. Tiny presets put the Qwen special tokens at the top of their 512-token vocab, in
the real order (<|endoftext|> = 486, <|im_start|> = 487, <|im_end|> = 488), as the synthetic tokenizer does.
"""

from __future__ import annotations

import copy

# The chat specials shared by every preset, in the order of the real vocabularies.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_VOCAB = 512


def _specials(first_id: int) -> dict[str, int]:
    return {token: first_id + i for i, token in enumerate(SPECIAL_TOKENS)}


def special_token_ids(config: dict) -> dict[str, int]:
    """The ids of <|endoftext|>, <|im_start|>, <|im_end|> implied by a config's eos_token_id.

    Qwen3-Next's eos is <|im_end|>; the Qwen3.5 family (and Flash-Next) use <|endoftext|>.
    """
    text = config.get("text_config", config)
    eos = text["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    return _specials(eos - 2 if config.get("model_type") == "qwen3_next" else eos)


def _layer_types(num_layers: int, attention: str = "full_attention") -> list[str]:
    return [attention if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]


def _rope(mrope: list[int] | None) -> dict:
    rope = {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25}
    if mrope is not None:
        rope.update(mrope_section=mrope, mrope_interleaved=True)
    return rope


def _vision(depth: int, hidden: int, heads: int, intermediate: int, out_hidden: int) -> dict:
    return {
        "depth": depth, "hidden_size": hidden, "num_heads": heads, "intermediate_size": intermediate,
        "out_hidden_size": out_hidden, "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
    }


def _multimodal(model_type: str, architecture: str, text: dict, vision: dict) -> dict:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": {"model_type": f"{model_type}_vision", **vision},
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
    }


def _hybrid_text(hidden, layers, heads, kv_heads, head_dim, k_heads, v_heads, gdn_dim, experts, top_k, width,
                 vocab, eos, max_positions) -> dict:
    return {
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "layer_types": _layer_types(layers), "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads,
        "linear_key_head_dim": gdn_dim, "linear_value_head_dim": gdn_dim, "linear_conv_kernel_dim": 4,
        "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width, "norm_topk_prob": True, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "max_position_embeddings": max_positions, "tie_word_embeddings": False, "use_cache": True,
        "router_aux_loss_coef": 0.001, "output_router_logits": False, "eos_token_id": eos, "dtype": "bfloat16",
    }


def _qwen4_exp(hidden, layers, heads, kv_heads, head_dim, k_heads, v_heads, gdn_dim, experts, top_k, width,
               vocab, eos, max_positions, mrope, hc, ple, indexer, vision, mtp_layers) -> dict:
    text = _hybrid_text(hidden, layers, heads, kv_heads, head_dim, k_heads, v_heads, gdn_dim, experts, top_k,
                        width, vocab, eos, max_positions)
    text.update(model_type="qwen4_exp_text", rope_parameters=_rope(mrope), output_gate_type="sigmoid",
                hc_count=hc[0], hc_lowrank=hc[1], mtp_num_hidden_layers=mtp_layers, **ple, **indexer)
    return _multimodal("qwen4_exp", "Qwen4ExpForConditionalGeneration", text, vision)


def _qwen3_5_moe(hidden, layers, heads, kv_heads, head_dim, k_heads, v_heads, gdn_dim, experts, top_k, width,
                 vocab, eos, max_positions, mrope, vision, mtp_layers) -> dict:
    text = _hybrid_text(hidden, layers, heads, kv_heads, head_dim, k_heads, v_heads, gdn_dim, experts, top_k,
                        width, vocab, eos, max_positions)
    text.update(model_type="qwen3_5_moe_text", rope_parameters=_rope(mrope), mtp_num_hidden_layers=mtp_layers)
    return _multimodal("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", text, vision)


def _qwen3_next(hidden, layers, heads, kv_heads, head_dim, k_heads, v_heads, gdn_dim, experts, top_k, width,
                vocab, eos, max_positions) -> dict:
    config = _hybrid_text(hidden, layers, heads, kv_heads, head_dim, k_heads, v_heads, gdn_dim, experts, top_k,
                          width, vocab, eos, max_positions)
    # The Qwen3-Next release predates rope_parameters and writes RoPE settings at the top level.
    config.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", bos_token_id=eos - 2,
                  rope_theta=10_000_000, partial_rotary_factor=0.25, rope_scaling=None, decoder_sparse_step=1,
                  mlp_only_layers=[], intermediate_size=4 * width if vocab == TINY_VOCAB else 5120)
    return {"architectures": config.pop("architectures"), **config}


_FLASH_NEXT_EOS = 248044  # <|endoftext|>; <|im_start|> 248045, <|im_end|> 248046
# The synthetic tokenizer puts Qwen's 26 added tokens (flashnext.tokenizer.synthetic.QWEN_ADDED_TOKENS, starting
# with <|endoftext|>) at the top of the vocab.
_TINY_EOS = TINY_VOCAB - 26

_PRESETS = {
    "flash-next": lambda: _qwen4_exp(
        2560, 48, 24, 2, 256, 16, 48, 128, 512, 10, 640, 248320, _FLASH_NEXT_EOS, 262144, [11, 11, 10], (4, 320),
        dict(ple_layer_ids=[2], ple_embed_dim=2560, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8,
             ngram_vocab_size_base=20_000_000, make_ngram_vocab_size_divisible_by=128, seed=1234,
             split_ngram_parts=512),
        dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
             indexer_compress_ratio=4),
        _vision(27, 1152, 16, 4304, 2560), 1),
    "qwen3-next-80b": lambda: _qwen3_next(
        2048, 48, 16, 2, 256, 16, 32, 128, 512, 10, 512, 151936, 151645, 262144),
    "qwen3.5-35b": lambda: _qwen3_5_moe(
        2048, 40, 16, 2, 256, 16, 32, 128, 256, 8, 512, 248320, _FLASH_NEXT_EOS, 262144, [11, 11, 10],
        _vision(27, 1152, 16, 4304, 2048), 1),
    "tiny-flash-next": lambda: _qwen4_exp(
        64, 4, 4, 2, 64, 2, 6, 16, 8, 2, 32, TINY_VOCAB, _TINY_EOS, 4096, [3, 3, 2], (2, 16),
        dict(ple_layer_ids=[2], ple_embed_dim=64, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2,
             ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=128, seed=1234, split_ngram_parts=2),
        dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8,
             indexer_compress_ratio=4),
        _vision(1, 32, 2, 64, 64), 0),
    "tiny-qwen3-next": lambda: _qwen3_next(64, 4, 4, 2, 64, 2, 4, 16, 8, 2, 32, TINY_VOCAB, _TINY_EOS + 2, 4096),
    "tiny-qwen3.5-moe": lambda: _qwen3_5_moe(
        64, 4, 4, 2, 64, 2, 6, 16, 8, 2, 32, TINY_VOCAB, _TINY_EOS, 4096, [3, 3, 2], _vision(1, 32, 2, 64, 64), 0),
}

PRESETS = tuple(_PRESETS)


def get_preset(name: str, layers: int | None = None) -> dict:
    """A fresh config.json dict for preset `name`; `layers` overrides the depth (keeping the 3:1 layer pattern)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    config = copy.deepcopy(_PRESETS[name]())
    if layers is not None:
        set_num_layers(config, layers)
    return config


def set_num_layers(config: dict, layers: int) -> None:
    """Change the depth of a config dict in place, keeping layer_types and PLE layer ids consistent."""
    text = config.get("text_config", config)
    if layers < 1:
        raise ValueError(f"a model needs at least one layer, got {layers}")
    old_types = text.get("layer_types") or _layer_types(text["num_hidden_layers"])
    attention = next((t for t in old_types if t != "linear_attention"), "full_attention")
    text["num_hidden_layers"] = layers
    text["layer_types"] = _layer_types(layers, attention)
    if text.get("ple_layer_ids"):
        text["ple_layer_ids"] = [i for i in text["ple_layer_ids"] if i <= layers]


def generation_config(config: dict) -> dict:
    """generation_config.json of the releases: stop on <|im_end|> or <|endoftext|>, sampling defaults."""
    ids = special_token_ids(config)
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
