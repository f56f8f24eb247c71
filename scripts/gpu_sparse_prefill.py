"""On the GPU machine: long-prompt prefill through per-query token lists (the Triton paged attention op, one row per
query) equals the mask path, fp32 and bf16, on tiny-flash-next (its QSA budget is 8 tokens, so lists are used past
64 tokens of context): whole prompts and uneven chunks. Exits non-zero on a mismatch.
Run: python3 scripts/gpu_sparse_prefill.py"""
import sys

import torch

from flashnext.engine.loading import load_model
from flashnext.models.layers import indexed_attention
from flashnext.models.session import Session


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> int:
    ids = torch.randint(3, 480, (700,), generator=torch.Generator().manual_seed(0)).cuda()
    ok = True
    for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        model = load_model("tiny-flash-next", "cuda", dtype).model
        lists = Session(model, 1024).extend(ids, all_logits=True)
        chunked, pos = [], 0
        s = Session(model, 1024)
        for size in (100, 333, 1, 266):
            chunked.append(s.extend(ids[pos: pos + size], all_logits=True))
            pos += size
        original = indexed_attention.lists_pay_off
        indexed_attention.lists_pay_off = lambda x, seg, indexer: False
        try:
            mask = Session(model, 1024).extend(ids, all_logits=True)
        finally:
            indexed_attention.lists_pay_off = original
        e1, e2 = rel(lists, mask), rel(torch.cat(chunked), mask)
        ok &= e1 < bound and e2 < bound
        print(f"{str(dtype):15} lists vs mask {e1:.1e}, chunked lists vs mask {e2:.1e} (bound {bound:g})")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
