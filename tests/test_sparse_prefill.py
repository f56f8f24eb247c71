"""Long-prompt prefill of Flash-Next attention through per-query token lists (the QSA selection as lists, read
by the paged decode-attention op) equals the mask path: whole prompts and uneven chunks, past the budget."""
import pytest
import torch

from flashnext.models.layers import indexed_attention
from flashnext.models.session import Session
from oracle import hf_model, ours_from_hf, rel_err


@pytest.fixture(scope="module")
def model():
    hf, raw = hf_model("qwen4_exp", seed=0)
    return ours_from_hf(hf, raw)


def test_token_lists_equal_the_mask(model, monkeypatch):
    ids = torch.randint(2, 500, (90,), generator=torch.Generator().manual_seed(11))
    monkeypatch.setattr(indexed_attention, "lists_pay_off", lambda x, seg, indexer: False)   # the mask path
    want = Session(model, 128).extend(ids, all_logits=True)
    used = []

    def pay_off(x, seg, indexer):
        used.append(seg.total_len)
        return seg.total_len > 2 * indexer.block_topk * indexer.ratio   # a low threshold: tiny prompts take lists

    monkeypatch.setattr(indexed_attention, "lists_pay_off", pay_off)
    whole = Session(model, 128).extend(ids, all_logits=True)
    s, parts, pos = Session(model, 128), [], 0
    for size in (7, 20, 1, 33, 29):
        parts.append(s.extend(ids[pos: pos + size], all_logits=True))
        pos += size
    assert pos == len(ids) and max(used) > 16
    assert rel_err(whole, want) < 1e-5
    assert rel_err(torch.cat(parts), want) < 1e-5
