"""QSA indexer of Flash-Next attention: which earlier tokens each query may attend to.

Every complete block of `compress_ratio` tokens gets one key: the fp32 mean of its raw indexer keys,
rounded to the activation dtype, k_layernorm'ed and RoPE'd at the block's first position. A query scores
blocks by Σ_heads relu(q_h · key_b) / √d, keeps the top budget/ratio blocks, and always sees the
1…ratio-1 tail tokens of its incomplete block. While a query has ≤ budget/ratio complete blocks it sees
everything: dense causal attention.

A pooled key never changes once its block is complete, so the pooled keys live in the KV pages
(`kv.index_keys`) and only the raw keys of the incomplete block are carried (`states.index_ring`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.models.context import ForwardContext, Segment
from flashnext.models.decode_batch import DecodeBatch
from flashnext.models.layers.norms import ZeroCenteredRMSNorm
from flashnext.ops.decode_linear import decode_linear
from flashnext.ops.norm_rope import norm_rope
from flashnext.ops.prefill_attention import QUERY_BLOCK
from flashnext.ops.qsa_key_append import qsa_key_append
from flashnext.ops.qsa_scores import qsa_block_scores, qsa_prefill_scores
from flashnext.ops.qsa_token_lists import compile_for_lengths, qsa_token_lists, qsa_top_blocks
from flashnext.weights.config import ModelConfig


SPARSE_PREFILL_BUDGETS = 8  # token lists pay off once the context is several budgets long (16K on Flash-Next)


class QSAIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.indexer_heads
        self.head_dim = cfg.indexer_head_dim
        self.ratio = cfg.indexer_compress_ratio
        self.block_topk = cfg.indexer_budget // cfg.indexer_compress_ratio
        # Above this many tokens of context a prefill segment attends through token lists, not a mask.
        self.sparse_prefill_min = SPARSE_PREFILL_BUDGETS * cfg.indexer_budget
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.num_heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = ZeroCenteredRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_layernorm = ZeroCenteredRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self._rope = [rope]   # shared with the model, kept out of the module tree (no duplicate buffers)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """index_qk_proj → (queries [.., Hi·D], raw key [.., D]). A 16-bit projection goes through decode_linear: at
        decode's one row cuBLAS took ~7 µs for its 3.3 MB on the H200, 12 launches a step (session 11's profile),
        where the Triton GEMV reads as much in ~3 µs; more rows fall back to F.linear inside it."""
        proj = self.index_qk_proj
        y = decode_linear(x, proj.weight) if type(proj) is nn.Linear else proj(x)
        return torch.split(y, [self.num_heads * self.head_dim, self.head_dim], dim=-1)

    def _raw_keys(self, x: torch.Tensor) -> torch.Tensor:
        """The raw key columns of index_qk_proj alone (a 16-bit projection: its last rows; the queries, 4 of its 5
        heads on Flash-Next, are not needed where nothing is scored)."""
        proj = self.index_qk_proj
        if type(proj) is nn.Linear:
            return F.linear(x, proj.weight[-self.head_dim:])
        return self._project(x)[1]

    def _lists(self, scores: torch.Tensor, pos: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ops/qsa_token_lists.py with this indexer's top-k (all blocks while there are fewer)."""
        return qsa_token_lists(scores, pos, min(self.block_topk, scores.shape[1]), self.ratio, limit)

    def token_lists(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext,
                    seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection of `forward` as token lists ([T, S] positions and validity) instead of a [T, total] mask,
        for long prompts (IndexedAttention uses it above `sparse_prefill_min` tokens of context)."""
        q = self._queries(x, cos, sin, ctx, seg)
        lists = [self._lists(scores, pos, seg.total_len) for pos, scores in self._scored_blocks(q, ctx, seg)]
        return torch.cat([i for i, _ in lists]), torch.cat([v for _, v in lists])

    def _queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext,
                 seg: Segment) -> torch.Tensor:
        """A prefill segment's index queries [T, Hi, D]; the blocks it completes go into the pages on the way."""
        q, raw = self._project(x)
        q = norm_rope(q.view(-1, self.num_heads, self.head_dim), self.q_layernorm.weight, self.q_layernorm.eps, cos, sin)
        self._append_block_keys(raw, ctx, seg)
        return q

    def _scored_blocks(self, q: torch.Tensor, ctx: ForwardContext, seg: Segment):
        """(query positions, block scores [n, total_len // ratio]) for QUERY_BLOCK queries at a time, so the scores
        stay QUERY_BLOCK × blocks; blocks not complete before a query score -inf."""
        num_blocks = seg.total_len // self.ratio
        per_page = ctx.kv.block_size // self.ratio
        block_ids = torch.arange(num_blocks, device=q.device)
        rows = seg.blocks[block_ids // per_page] * per_page + block_ids % per_page
        keys = ctx.kv.index_keys[self.layer_idx].view(-1, self.head_dim)[rows]
        query_pos = torch.arange(seg.context_len, seg.total_len, device=q.device)
        complete_before = (query_pos + 1) // self.ratio
        for start in range(0, seg.length, QUERY_BLOCK):
            end = min(start + QUERY_BLOCK, seg.length)
            yield query_pos[start:end], qsa_prefill_scores(q[start:end], keys, complete_before[start:end])

    def _key(self, pooled: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pooled raw keys [B, D] → block keys: k_layernorm'ed and RoPE'd at the block's first position."""
        return norm_rope(pooled[:, None, :], self.k_layernorm.weight, self.k_layernorm.eps, cos, sin)[:, 0]

    def _append_block_keys(self, raw: torch.Tensor, ctx: ForwardContext, seg: Segment) -> None:
        """Pool the blocks this segment completes into the pages; keep the remainder in the ring."""
        ring = ctx.states.index_ring[self.layer_idx][seg.slot]
        first_block = seg.context_len // self.ratio
        pending = torch.cat([ring[: seg.context_len % self.ratio], raw], dim=0)
        complete = pending.shape[0] // self.ratio
        if complete:
            groups = pending[: complete * self.ratio].view(complete, self.ratio, self.head_dim)
            pooled = groups.float().mean(dim=1).to(raw.dtype)
            starts = (first_block + torch.arange(complete, device=raw.device)) * self.ratio
            cos, sin = self._rope[0](starts, raw.dtype)
            keys = self._key(pooled, cos, sin)
            per_page = ctx.kv.block_size // self.ratio
            block_ids = first_block + torch.arange(complete, device=raw.device)
            rows = seg.blocks[block_ids // per_page] * per_page + block_ids % per_page
            ctx.kv.index_keys[self.layer_idx].view(-1, self.head_dim)[rows] = keys
        rest = pending[complete * self.ratio:]
        ring[: rest.shape[0]] = rest

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext,
                seg: Segment) -> torch.Tensor | None:
        """x [T, hidden] of one segment → chosen [T, total_len // ratio] bool: the complete blocks each query attends
        to (ops/prefill_attention adds the tail of its incomplete block and the causal limit); None while the
        segment ends within the top-k blocks: every complete block is chosen then, which is dense causal attention
        (as `decode` does) — nothing scored, and no list kernel compiled for each of the block counts below top-k on
        a short prompt's way."""
        num_blocks = seg.total_len // self.ratio
        if num_blocks <= self.block_topk:
            self._append_block_keys(self._raw_keys(x), ctx, seg)
            return None
        q = self._queries(x, cos, sin, ctx, seg)
        chosen = torch.zeros(seg.length, num_blocks, dtype=torch.bool, device=x.device)
        start = 0
        for pos, scores in self._scored_blocks(q, ctx, seg):
            top = qsa_top_blocks(scores, self.block_topk)
            # with fewer than k complete blocks before a query some chosen ones are at -inf: those stay unchosen
            chosen[start: start + len(pos)].scatter_(1, top, scores.gather(1, top) > float("-inf"))
            start += len(pos)
        return chosen

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: DecodeBatch):
        """One token per row → (token_index [B, T], token_valid [B, T]) with T = top-k blocks × ratio + ratio - 1,
        or None when the block table is too short to hold more complete blocks than the top-k: then every row
        sees everything (dense causal attention) and nothing needs scoring — decided by the static table width.

        Fixed shapes for a CUDA graph: every block slot of the padded block table is scored and the ones not yet
        complete are masked, and the new key is pooled every step but final only where its block completes (else
        it goes into the row of the incomplete block itself, which nothing reads before it completes; a chained
        batch's kernel writes only completed blocks' keys)."""
        q, raw = self._project(x)
        pos, r = batch.positions, self.ratio
        keys = batch.kv.index_keys[self.layer_idx]                                 # [blocks, per_page, D]
        per_page = keys.shape[1]
        qsa_key_append(raw, batch.states.index_ring[self.layer_idx], batch.slots, pos, batch.block_table, keys,
                       self.k_layernorm.weight, self.k_layernorm.eps, self._rope[0].inv_freq, chained=batch.chained)

        capacity = batch.block_table.shape[1] * per_page                         # block slots of the table
        if capacity <= self.block_topk:
            return None
        q = norm_rope(q.view(-1, self.num_heads, self.head_dim), self.q_layernorm.weight, self.q_layernorm.eps, cos, sin)
        scores = qsa_block_scores(q, keys, batch.block_table, (pos + 1) // r)
        return self._lists(scores, pos, capacity * r)


def compile_selection_kernels(cfg: ModelConfig, device: torch.device, max_len: int) -> None:
    """The QSA list kernels compiled for every block count a request up to max_len tokens can meet
    (ops/qsa_token_lists.compile_for_lengths), at the warm-up of every rank; nothing for a model without an
    indexer."""
    if cfg.indexer_budget:
        ratio = cfg.indexer_compress_ratio
        compile_for_lengths(device, cfg.indexer_budget // ratio, ratio, -(-max_len // ratio),
                            SPARSE_PREFILL_BUDGETS * cfg.indexer_budget // ratio)
