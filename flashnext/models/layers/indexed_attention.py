"""Flash-Next attention: gated attention restricted to the tokens the QSA indexer selects."""
from flashnext.models.layers.attention import GatedAttention
from flashnext.models.layers.qsa_indexer import QSAIndexer
from flashnext.weights.config import ModelConfig


class IndexedAttention(GatedAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope):
        super().__init__(cfg, layer_idx)
        self.indexer = QSAIndexer(cfg, layer_idx, rope)

    def token_mask(self, x, cos, sin, ctx, seg):
        return self.indexer(x, cos, sin, ctx, seg)

    def decode_selection(self, x, cos, sin, batch):
        return self.indexer.decode(x, cos, sin, batch)
