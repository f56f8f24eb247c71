"""Qwen3-Next (`qwen3_next`, also Qwen3-Coder-Next): hybrid GatedDeltaNet / gated attention with a plain
pre-norm residual, sparse MoE (or a dense MLP on `mlp_only_layers`) and a final norm.
GatedDeltaNet projections are fused per key-head group (in_proj_qkvz, in_proj_ba).
"""
import torch
from torch import nn

from flashnext.models.context import ForwardContext
from flashnext.models.decode_batch import DecodeBatch
from flashnext.models.layers.attention import GatedAttention
from flashnext.models.layers.gated_delta_net import GatedDeltaNet
from flashnext.models.layers.moe import DenseMLP, SparseMoe
from flashnext.models.layers.norms import ZeroCenteredRMSNorm
from flashnext.models.layers.rope import RotaryEmbedding
from flashnext.weights.config import ModelConfig


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.is_linear = cfg.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx)
        self.mlp = SparseMoe(cfg) if cfg.sparse_layers[layer_idx] else DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, h, cos, sin, ctx: ForwardContext):
        x = ctx.rows("input_norm", self.input_layernorm, h)
        mixed = self.linear_attn(x, ctx) if self.is_linear else self.self_attn(x, cos, sin, ctx)
        return ctx.rows("mlp", self._residual_and_mlp, h, mixed)

    def _residual_and_mlp(self, h, mixed):
        """After the token mixer (row-wise): its residual, then the MLP block's."""
        h = h + mixed
        return h + self.mlp(self.post_attention_layernorm(h))

    def decode(self, h, cos, sin, batch: DecodeBatch):
        x = self.input_layernorm(h)
        h = h + (self.linear_attn.decode(x, batch) if self.is_linear else self.self_attn.decode(x, cos, sin, batch))
        return h + self.mlp.decode(self.post_attention_layernorm(h))


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = ctx.rows("embed", self.embed_tokens, input_ids)
        cos, sin = ctx.rows("rotary", lambda positions: self.rotary(positions, self.embed_tokens.weight.dtype), ctx.positions)
        for layer in self.layers:
            h = layer(h, cos, sin, ctx)
        return ctx.rows("norm", self.norm, h)

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions, h.dtype)
        for layer in self.layers:
            h = layer.decode(h, cos, sin, batch)
        return self.norm(h)


class Qwen3NextForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = HybridModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        """Hidden states of one new token per row, in fixed shapes (models/decode_batch.py)."""
        return self.model.decode(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
