"""Flash-Next attention: gated attention restricted to the tokens the QSA indexer selects."""
from flashnext.models.layers.attention import GatedAttention
from flashnext.models.layers.qsa_indexer import QSAIndexer
from flashnext.weights.config import ModelConfig


def lists_pay_off(x, seg, indexer: QSAIndexer) -> bool:
    """Token lists for long segments: the attention op then reads ≤ top-k · ratio + ratio − 1 tokens per query."""
    return seg.total_len > indexer.sparse_prefill_min


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
