"""Qwen3.8-Flash-Next (`qwen4_exp`): hybrid GatedDeltaNet / QSA-indexed attention, sparse MoE in every
layer, four hyper-connection residual streams, PLE n-gram embeddings on one early layer.

Layer i: [PLE] → hyper-connection → (GatedDeltaNet | IndexedAttention) → inject → hyper-connection →
SparseMoe → inject. No pre-norms and no final norm: the mixers normalise; a final mixer feeds lm_head.
"""
import torch
from torch import nn

from flashnext.models.context import ForwardContext
from flashnext.models.decode_batch import DecodeBatch
from flashnext.models.layers.gated_delta_net import GatedDeltaNet
from flashnext.models.layers.hyper_connection import HyperConnection
from flashnext.models.layers.indexed_attention import IndexedAttention
from flashnext.models.layers.moe import SparseMoe
from flashnext.models.layers.ple import PLELayer
from flashnext.models.layers.rope import RotaryEmbedding
from flashnext.ops.hyper_connection import PendingInjection
from flashnext.weights.config import ModelConfig


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.is_linear = cfg.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = IndexedAttention(cfg, layer_idx, rope)
        self.mlp = SparseMoe(cfg)
        self.ple = PLELayer(cfg, layer_idx, cfg.ple_layers.index(layer_idx)) if layer_idx in cfg.ple_layers else None
        self.attn_hyper_connection = HyperConnection(cfg)
        self.mlp_hyper_connection = HyperConnection(cfg)

    def forward(self, h, input_ids, cos, sin, ctx: ForwardContext):
        if self.ple is not None:
            h = h + self.ple(h, input_ids, ctx)
        x, inject = ctx.rows("attn_mix", self.attn_hyper_connection.mix, h)
        x = self.linear_attn(x, ctx) if self.is_linear else self.self_attn(x, cos, sin, ctx)
        return ctx.rows("mlp", self._inject_and_mlp, h, x, inject)

    def _inject_and_mlp(self, h, x, inject):
        """After the token mixer (row-wise): its injection, then the MoE block and its injection."""
        h = HyperConnection.inject(h, x, inject)
        x, inject = self.mlp_hyper_connection.mix(h)
        return HyperConnection.inject(h, self.mlp(x), inject)

    def decode(self, h, cos, sin, batch: DecodeBatch):
        """h: the streams, or the previous layer's streams with its last injection pending; returns this layer's
        with its own pending (each injection is done by the next mix's first kernel)."""
        if self.ple is not None:
            h = h.materialize() if isinstance(h, PendingInjection) else h
            h = h + self.ple.decode(h, batch)
        x, inject, h = self.attn_hyper_connection.decode_mix(h)
        x = self.linear_attn.decode(x, batch) if self.is_linear else self.self_attn.decode(x, cos, sin, batch)
        x, inject, h = self.mlp_hyper_connection.decode_mix(PendingInjection(h, x, inject))
        return PendingInjection(h, self.mlp.decode(x), inject)


class Qwen4ExpModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        self.layers = nn.ModuleList(Qwen4ExpDecoderLayer(cfg, i, self.rotary) for i in range(cfg.num_layers))
        self.hyper_connection_mixer = HyperConnection(cfg, with_injection=False)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = ctx.rows("embed", self._streams, input_ids)
        cos, sin = ctx.rows("rotary", self._rotary, ctx.positions)
        for layer in self.layers:
            h = layer(h, input_ids, cos, sin, ctx)
        return ctx.rows("final_mix", lambda streams: self.hyper_connection_mixer.mix(streams)[0], h)

    def _streams(self, input_ids):
        return self.embed_tokens(input_ids).repeat(1, self.cfg.hc_count)   # every stream starts as the embedding

    def _rotary(self, positions):
        return self.rotary(positions, self.embed_tokens.weight.dtype)

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        e = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions, e.dtype)
        h = e.repeat(1, self.cfg.hc_count)
        for layer in self.layers:
            h = layer.decode(h, cos, sin, batch)
        return self.hyper_connection_mixer.decode_mix(h)[0]


class Qwen4ExpForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Qwen4ExpModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        """Hidden states of one new token per row, in fixed shapes (models/decode_batch.py)."""
        return self.model.decode(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
