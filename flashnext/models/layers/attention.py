"""Gated attention over paged KV: per head q_proj gives [query | gate]; zero-centred q/k norms; partial
RoPE; GQA; output × sigmoid(gate) → o_proj. `token_mask` lets indexed attention restrict each query to
the tokens its indexer selected (None: plain causal attention).
"""
import torch
import torch.nn.functional as F
from torch import nn

from flashnext.models.context import ForwardContext, Segment
from flashnext.models.decode_batch import DecodeBatch
from flashnext.models.layers.norms import ZeroCenteredRMSNorm
from flashnext.ops.decode_attention import decode_attention
from flashnext.ops.norm_rope import norm_rope
from flashnext.weights.config import ModelConfig

QUERY_BLOCK = 1024


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scaling = self.head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def token_mask(self, x, cos, sin, ctx: ForwardContext, seg: Segment) -> torch.Tensor | None:
        return None

    def token_lists(self, x, cos, sin, ctx: ForwardContext, seg: Segment) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a long segment, (token_index [T, S], token_valid [T, S]) of what each query attends to, so that
        attention reads S tokens per query instead of a [T, total] mask; None: use token_mask."""
        return None

    def decode_selection(self, x, cos, sin, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token_index [B, T], token_valid [B, T]) each row may attend to, or None: every earlier token."""
        return None

    def _qkv(self, x, cos, sin):
        n = x.shape[0]
        q, gate = self.q_proj(x).view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)
        k = norm_rope(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), self.k_norm.weight, self.k_norm.eps,
                      cos, sin)
        return q, gate, k, self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One token per row: write its K/V into the row's page, attend over the pages (ops.decode_attention)."""
        q, gate, k, v = self._qkv(x, cos, sin)
        k_cache, v_cache = batch.kv.k[self.layer_idx], batch.kv.v[self.layer_idx]
        rows = batch.token_rows
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, rows, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, rows, v)
        selection = self.decode_selection(x, cos, sin, batch)
        token_index, token_valid = selection if selection is not None else (None, None)
        out = decode_attention(q, k_cache, v_cache, batch.block_table, batch.seq_lens, self.scaling,
                               token_index=token_index, token_valid=token_valid)
        return self.o_proj(out.reshape(x.shape[0], -1) * torch.sigmoid(gate.reshape(x.shape[0], -1)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n = x.shape[0]
        q, gate, k, v = self._qkv(x, cos, sin)
        k_cache = ctx.kv.k[self.layer_idx].view(-1, self.num_kv_heads, self.head_dim)
        v_cache = ctx.kv.v[self.layer_idx].view(-1, self.num_kv_heads, self.head_dim)
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        for seg in ctx.segments:
            rows = slice(seg.start, seg.end)
            new_rows = ctx.kv.token_rows(seg.blocks, seg.context_len, seg.total_len)
            k_cache[new_rows] = k[rows]
            v_cache[new_rows] = v[rows]
            lists = self.token_lists(x[rows], cos[rows], sin[rows], ctx, seg)
            if lists is not None:
                out[rows] = self._attend_lists(q[rows], ctx, seg, *lists)
                continue
            all_rows = ctx.kv.token_rows(seg.blocks, 0, seg.total_len)
            mask = self.token_mask(x[rows], cos[rows], sin[rows], ctx, seg)
            out[rows] = self._attend(q[rows], k_cache[all_rows], v_cache[all_rows], seg, mask)
        out = out.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(out)

    def _attend_lists(self, q, ctx: ForwardContext, seg: Segment, token_index, token_valid) -> torch.Tensor:
        """Each query of the segment over its own token list, through the paged decode-attention op (one row per
        query, the segment's block table shared): work and memory O(T · S), nothing O(T · total)."""
        queries = torch.arange(seg.context_len, seg.total_len, device=q.device)
        table = seg.blocks[None, :].expand(seg.length, -1)
        return decode_attention(q, ctx.kv.k[self.layer_idx], ctx.kv.v[self.layer_idx], table, queries + 1,
                                self.scaling, token_index=token_index, token_valid=token_valid)

    def _attend(self, q, k, v, seg: Segment, mask: torch.Tensor | None) -> torch.Tensor:
        """q [T, H, D]; k, v [L, KVH, D] with L = context + T → [T, H, D].

        Queries go in blocks so a long prefill holds at most QUERY_BLOCK × L of mask (and, where SDPA falls back
        to its math kernel, of scores) at a time instead of T × L.
        """
        k, v = k.transpose(0, 1), v.transpose(0, 1)            # [KVH, L, D]
        token = torch.arange(seg.total_len, device=q.device)
        out = torch.empty_like(q)
        for start in range(0, seg.length, QUERY_BLOCK):
            end = min(start + QUERY_BLOCK, seg.length)
            query_pos = seg.context_len + torch.arange(start, end, device=q.device)
            visible = token[None, :] <= query_pos[:, None]
            if mask is not None:
                visible = visible & mask[start:end]
            o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k, v, attn_mask=visible,
                                               scale=self.scaling, enable_gqa=True)
            out[start:end] = o.transpose(0, 1)
        return out
