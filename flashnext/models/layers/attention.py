"""Gated attention over paged KV: per head q_proj gives [query | gate]; zero-centred q/k norms; partial
RoPE; GQA; output × sigmoid(gate) → o_proj. `block_selection` / `token_lists` / `decode_selection` let indexed
attention restrict each query to the tokens its indexer selected (None: plain causal attention).
"""
import torch
from torch import nn

from flashnext.models.context import ForwardContext, Segment
from flashnext.models.decode_batch import DecodeBatch
from flashnext.models.layers.norms import ZeroCenteredRMSNorm
from flashnext.ops import branches
from flashnext.ops.decode_attention import decode_attention
from flashnext.ops.gated_elementwise import sigmoid_gate
from flashnext.ops.norm_rope import norm_rope
from flashnext.ops.prefill_attention import prefill_attention
from flashnext.weights.config import ModelConfig


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
        self.project_qkv = None   # q, k and v in one GEMM once the model is loaded (models/stacked.py)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def block_selection(self, x, cos, sin, ctx: ForwardContext, seg: Segment) -> tuple[torch.Tensor, int] | None:
        """(chosen [T, blocks] bool, tokens per block): the complete blocks each query of the segment attends to
        besides its own incomplete block (ops/prefill_attention); None: every earlier token."""
        return None

    def token_lists(self, x, cos, sin, ctx: ForwardContext, seg: Segment) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a long segment, (token_index [T, S], token_valid [T, S]) of what each query attends to, so that
        attention reads S tokens per query instead of walking every earlier key; None: use block_selection."""
        return None

    def decode_selection(self, x, cos, sin, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token_index [B, T], token_valid [B, T]) each row may attend to, or None: every earlier token."""
        return None

    def _qkv(self, x, cos, sin):
        n = x.shape[0]
        q, k, v = self.project_qkv(x) if self.project_qkv is not None else (self.q_proj(x), self.k_proj(x),
                                                                           self.v_proj(x))
        q, gate = q.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)
        k = norm_rope(k.view(n, self.num_kv_heads, self.head_dim), self.k_norm.weight, self.k_norm.eps, cos, sin)
        return q, gate, k, v.view(n, self.num_kv_heads, self.head_dim)

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One token per row: write its K/V into the row's page, attend over the pages (ops.decode_attention)."""
        # the token selection (QSA's indexer) reads only x and its own keys: a parallel branch (ops.branches)
        (q, gate, k, v), selection = branches.parallel(x, lambda: self._qkv(x, cos, sin),
                                                       lambda: self.decode_selection(x, cos, sin, batch))
        k_cache, v_cache = batch.kv.k[self.layer_idx], batch.kv.v[self.layer_idx]
        rows = batch.token_rows
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, rows, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, rows, v)
        token_index, token_valid = selection if selection is not None else (None, None)
        out = decode_attention(q, k_cache, v_cache, batch.block_table, batch.seq_lens, self.scaling,
                               token_index=token_index, token_valid=token_valid)
        return self._gated_output(out, gate)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n = x.shape[0]
        q, gate, k, v = ctx.rows("attn_qkv", self._qkv, x, cos, sin)
        k_pages, v_pages = ctx.kv.k[self.layer_idx], ctx.kv.v[self.layer_idx]
        k_cache = k_pages.view(-1, self.num_kv_heads, self.head_dim)
        v_cache = v_pages.view(-1, self.num_kv_heads, self.head_dim)
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
            selection = self.block_selection(x[rows], cos[rows], sin[rows], ctx, seg)
            chosen, ratio = selection if selection is not None else (None, 1)
            out[rows] = prefill_attention(q[rows], k_pages, v_pages, seg.blocks, seg.context_len, self.scaling,
                                          chosen, ratio)
        return ctx.rows("attn_out", self._gated_output, out, gate)

    def _gated_output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.o_proj(sigmoid_gate(out, gate))   # out: [N, heads, D] as sigmoid_gate wants it

    def _attend_lists(self, q, ctx: ForwardContext, seg: Segment, token_index, token_valid) -> torch.Tensor:
        """Each query of the segment over its own token list, through the paged decode-attention op (one row per
        query, the segment's block table shared): work and memory O(T · S), nothing O(T · total)."""
        queries = torch.arange(seg.context_len, seg.total_len, device=q.device)
        table = seg.blocks[None, :].expand(seg.length, -1)
        return decode_attention(q, ctx.kv.k[self.layer_idx], ctx.kv.v[self.layer_idx], table, queries + 1,
                                self.scaling, token_index=token_index, token_valid=token_valid)
