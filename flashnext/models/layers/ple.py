"""Flash-Next PLE: hashed n-gram embeddings injected into every residual stream of one layer.

For each token, the ids of it and its predecessors (an EOS among them resets history to EOS) are mixed
by multiply-xor with per-order multipliers, reduced modulo one prime per head, and gathered from one big
table (16 heads × 160 in the release). key_proj / value_proj turn the gathered rows into per-stream keys
and one value; a signed-sqrt sigmoid gate from normed key · normed stream scales the value per stream,
and a dilated causal depthwise conv (kernel 4, dilation = ngram_size) of the normed gated values adds
local context. State per sequence: the last ngram_size-1 ids and the conv tail.
"""
import math

import torch
from torch import nn

from flashnext.models.context import ForwardContext
from flashnext.models.decode_batch import DecodeBatch
from flashnext.models.layers.norms import ZeroCenteredRMSNorm
from flashnext.models.layers.row_table import RowTable
from flashnext.ops.causal_conv1d import causal_conv1d
from flashnext.weights.config import ModelConfig

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def ngram_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd multipliers below 2^63 / vocab, so token·multiplier never overflows int64 before the xor."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def ngram_head_sizes(base: int, num_heads: int, ple_index: int) -> list[int]:
    """Head h of PLE layer l uses the (l·heads + h + 1)-th prime above base - 1: all heads distinct."""
    sizes, prime = [], base - 1
    for _ in range(ple_index * num_heads):
        prime += 1
        while not _is_prime(prime):
            prime += 1
    for _ in range(num_heads):
        prime += 1
        while not _is_prime(prime):
            prime += 1
        sizes.append(prime)
    return sizes


class NGramEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, ple_index: int):
        super().__init__()
        self.ngram_size = cfg.ngram_size
        self.heads_per_ngram = cfg.heads_per_ngram
        self.eos = cfg.eos_token_id
        heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
        sizes = ngram_head_sizes(cfg.ngram_vocab_size_base, heads, ple_index)
        offsets = [sum(sizes[:i]) for i in range(heads)]
        rows = math.ceil(sum(sizes) / cfg.ngram_vocab_divisible_by) * cfg.ngram_vocab_divisible_by
        # Derived on the CPU even when the model is built on "meta": the loader checks the checkpoint's
        # copies against these values, so they must exist before any weight is read.
        cpu = torch.device("cpu")
        multipliers = ngram_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.ngram_seed)
        self.register_buffer("layer_multipliers", torch.tensor(multipliers, dtype=torch.long, device=cpu))
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes, dtype=torch.long, device=cpu))
        self.register_buffer("ngram_heads_offsets", torch.tensor(offsets, dtype=torch.long, device=cpu))
        self.ngram_embedding = RowTable(rows, cfg.ple_embed_dim // heads)

    def row_ids(self, history: torch.Tensor, length: int) -> torch.Tensor:
        """history [..., ngram_size-1 + T] ids (carried ids first) → table rows [..., T, heads]."""
        context = self.ngram_size - 1
        hist = history.long()
        is_eos = hist == self.eos
        idx = torch.arange(context, context + length, device=hist.device)
        shifted = []
        for shift in range(self.ngram_size):
            src = hist[..., idx - shift]
            # an EOS anywhere in [i - shift, i - 1] cuts the n-gram: the predecessor reads as EOS
            cut = torch.zeros_like(src, dtype=torch.bool)
            for back in range(1, shift + 1):
                cut |= is_eos[..., idx - back]
            shifted.append(torch.where(cut, torch.full_like(src, self.eos), src))
        blocks = []
        for n in range(2, self.ngram_size + 1):
            mixed = shifted[0] * self.layer_multipliers[0]
            for p in range(1, n):
                mixed = torch.bitwise_xor(mixed, shifted[p] * self.layer_multipliers[p])
            lo = (n - 2) * self.heads_per_ngram
            sizes = self.ngram_heads_vocab_sizes[lo: lo + self.heads_per_ngram]
            offsets = self.ngram_heads_offsets[lo: lo + self.heads_per_ngram]
            blocks.append(torch.remainder(mixed[..., None], sizes) + offsets)
        return torch.cat(blocks, dim=-1)

    def forward(self, history: torch.Tensor, length: int) -> torch.Tensor:
        rows = self.row_ids(history, length)
        return self.ngram_embedding(rows).flatten(-2)


class PLELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ple_index: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hc = cfg.hc_count
        self.hidden = cfg.hidden_size
        width = cfg.hc_hidden_size
        self.dilation = cfg.ngram_size
        self.ple_embedding = NGramEmbedding(cfg, ple_index)
        self.key_proj = nn.Linear(cfg.ple_embed_dim, width, bias=False)
        self.value_proj = nn.Linear(cfg.ple_embed_dim, cfg.hidden_size, bias=False)
        self.norm_key = ZeroCenteredRMSNorm(width, eps=cfg.rms_norm_eps, group_size=cfg.hidden_size)
        self.norm_query = ZeroCenteredRMSNorm(width, eps=cfg.rms_norm_eps, group_size=cfg.hidden_size)
        self.norm_conv = ZeroCenteredRMSNorm(width, eps=cfg.rms_norm_eps, group_size=cfg.hidden_size)
        self.conv1d = nn.Conv1d(width, width, cfg.ple_conv_kernel, groups=width, dilation=cfg.ngram_size, bias=False)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ids_state, conv_state = ctx.states.ple_ids[self.layer_idx], ctx.states.ple_conv[self.layer_idx]
        emb = torch.empty(h.shape[0], self.value_proj.in_features, dtype=h.dtype, device=h.device)
        for seg in ctx.segments:
            emb[seg.start: seg.end], ids_state[seg.slot] = self._embed(ids_state[seg.slot], input_ids[seg.start: seg.end])
        gated = self._gated(h, emb)
        normed = self.norm_conv(gated)
        conv_out = torch.empty_like(gated)
        for seg in ctx.segments:
            rows = slice(seg.start, seg.end)
            conv_out[rows], conv_state[seg.slot] = self._conv(normed[rows], conv_state[seg.slot])
        return gated + conv_out

    def _embed(self, carried: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's n-gram rows of `ids` after its carried ids → (embeddings [T, E], the ids to carry)."""
        history = torch.cat([carried, ids])
        return self.ple_embedding(history, ids.shape[0]), history[-carried.shape[0]:]

    def _conv(self, normed: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv1d(normed, self.conv1d.weight.squeeze(1), tail, self.dilation)

    def _decode_chain(self, h: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """A chained batch (models/decode_batch.py): its rows as one prefill segment, the slot by device index."""
        ids_state, conv_state = batch.states.ple_ids[self.layer_idx], batch.states.ple_conv[self.layer_idx]
        emb, carried = self._embed(batch.chain_state(ids_state), batch.input_ids)
        batch.set_chain_state(ids_state, carried)
        gated = self._gated(h, emb.to(h.dtype))
        conv, tail = self._conv(self.norm_conv(gated), batch.chain_state(conv_state))
        batch.set_chain_state(conv_state, tail)
        return gated + conv

    def _gated(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The value of each token's n-gram rows, gated per stream by signed-sqrt key · query."""
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.hc, self.hidden))
        value = self.value_proj(emb)
        query = self.norm_query(h).unflatten(-1, (self.hc, self.hidden))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        return (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)

    def decode(self, h: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One token per row; the id history and the conv tail of each row's slot move on by one."""
        if batch.chained:
            return self._decode_chain(h, batch)
        ids_state, conv_state = batch.states.ple_ids[self.layer_idx], batch.states.ple_conv[self.layer_idx]
        history = torch.cat([ids_state[batch.slots], batch.input_ids[:, None]], dim=1)     # [B, ngram_size]
        ids_state[batch.slots] = history[:, 1:]
        emb = self.ple_embedding(history, 1)[:, 0].to(h.dtype)
        gated = self._gated(h, emb)
        conv, conv_state[batch.slots] = causal_conv1d(self.norm_conv(gated)[:, None, :], self.conv1d.weight.squeeze(1),
                                                      conv_state[batch.slots], self.dilation)
        return gated + conv[:, 0]
