"""Flash-Next attention: gated attention restricted to the tokens the QSA indexer selects."""
import torch

from flashnext.models.layers.attention import GatedAttention
from flashnext.models.layers.qsa_indexer import SPARSE_PREFILL_BUDGETS, QSAIndexer
from flashnext.weights.config import ModelConfig


def lists_pay_off(x, seg, indexer: QSAIndexer) -> bool:
    """Token lists for long segments: the attention op then reads ≤ top-k · ratio + ratio − 1 tokens per query."""
    return seg.total_len > indexer.sparse_prefill_min


def compile_list_attention(cfg: ModelConfig, page: int, dtype: torch.dtype, device: torch.device, max_len: int) -> None:
    """The token-list attention of a long prompt's chunks compiled at the engine's warm-up, where requests of
    `max_len` tokens can reach it (ops/decode_attention_triton.LIST_ROWS); a no-op off CUDA and without an indexer."""
    if torch.device(device).type != "cuda" or not cfg.indexer_budget or max_len <= SPARSE_PREFILL_BUDGETS * cfg.indexer_budget:
        return
    from flashnext.ops.decode_attention_triton import compile_list_rows

    ratio = cfg.indexer_compress_ratio
    width = cfg.indexer_budget // ratio * ratio + ratio - 1
    compile_list_rows(cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim, page, width, dtype, device)


class IndexedAttention(GatedAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope):
        super().__init__(cfg, layer_idx)
        self.indexer = QSAIndexer(cfg, layer_idx, rope)

    def block_selection(self, x, cos, sin, ctx, seg):
        chosen = self.indexer(x, cos, sin, ctx, seg)
        return (chosen, self.indexer.ratio) if chosen is not None else None

    def token_lists(self, x, cos, sin, ctx, seg):
        return self.indexer.token_lists(x, cos, sin, ctx, seg) if lists_pay_off(x, seg, self.indexer) else None

    def decode_selection(self, x, cos, sin, batch):
        return self.indexer.decode(x, cos, sin, batch)
