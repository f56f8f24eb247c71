"""Paged prefill attention: the reference against a per-query loop written from the definition (causal, QSA
selection with tails), and the Triton flash-attention kernel (CPU: TRITON_INTERPRET=1) against the reference at
odd sizes: segments that start mid-page, queries not a multiple of the tile, shuffled pages, GQA."""

import pytest
import torch

from flashnext.ops.prefill_attention import prefill_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(context, length, heads, kv_heads, dim, page, ratio=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = context + length
    pages = -(-total // page) + 3
    blocks = torch.randperm(pages, generator=gen)[: -(-total // page)]
    case = {
        "q": torch.randn(length, heads, dim, generator=gen).to(dtype),
        "k_cache": torch.randn(pages, page, kv_heads, dim, generator=gen).to(dtype),
        "v_cache": torch.randn(pages, page, kv_heads, dim, generator=gen).to(dtype),
        "blocks": blocks, "context_len": context, "scale": dim ** -0.5}
    if ratio:
        # a random selection among the blocks complete before each query (what the indexer's top-k gives)
        pos = context + torch.arange(length)
        nblk = total // ratio
        chosen = torch.rand(length, nblk, generator=gen) < 0.4
        chosen &= torch.arange(nblk)[None, :] < ((pos + 1) // ratio)[:, None]
        case.update(chosen=chosen, ratio=ratio)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def by_definition(case):
    q, k_cache, v_cache = case["q"].double(), case["k_cache"].double(), case["v_cache"].double()
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.zeros_like(q)
    for t in range(q.shape[0]):
        p = case["context_len"] + t
        seen = []
        for j in range(p + 1):
            if "chosen" in case:
                r = case["ratio"]
                tail = j >= (p + 1) // r * r
                if not (tail or bool(case["chosen"][t, j // r])):
                    continue
            seen.append(j)
        rows = [int(case["blocks"][j // page]) * page + j % page for j in seen]
        k = k_cache.reshape(-1, kv_heads, k_cache.shape[-1])[rows]      # [S, KVH, D]
        v = v_cache.reshape(-1, kv_heads, k_cache.shape[-1])[rows]
        for h in range(q.shape[1]):
            w = torch.softmax((k[:, h // group] @ q[t, h]) * case["scale"], dim=0)
            out[t, h] = w @ v[:, h // group]
    return out


@pytest.mark.parametrize("ratio", [None, 4])
def test_reference_is_the_definition(ratio):
    case = make_case(context=21, length=30, heads=4, kv_heads=2, dim=8, page=8, ratio=ratio)
    got = prefill_attention_reference(**case)
    assert torch.allclose(got.double(), by_definition(case), atol=1e-5)


def test_reference_selection_changes_the_answer():
    case = make_case(context=40, length=9, heads=2, kv_heads=1, dim=8, page=4, ratio=4)
    dense = {k: v for k, v in case.items() if k not in ("chosen", "ratio")}
    assert not torch.allclose(prefill_attention_reference(**case), prefill_attention_reference(**dense), atol=1e-3)


@pytest.mark.parametrize("context,length,page,ratio", [(0, 37, 16, None), (19, 45, 16, None), (5, 33, 4, 4),
                                                       (70, 17, 16, 4), (0, 50, 8, 4)])
def test_triton_matches_reference(context, length, page, ratio):
    from flashnext.ops.prefill_attention_triton import prefill_attention_triton

    case = make_case(context=context, length=length, heads=6, kv_heads=2, dim=32, page=page, ratio=ratio, seed=length)
    want = prefill_attention_reference(**case)
    got = prefill_attention_triton(**case)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err


def test_triton_half_precision_within_rounding():
    from flashnext.ops.prefill_attention_triton import prefill_attention_triton

    case = make_case(context=12, length=40, heads=4, kv_heads=1, dim=16, page=16, ratio=4, dtype=torch.float16)
    want = prefill_attention_reference(**{k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                                          for k, v in case.items()})
    got = prefill_attention_triton(**case).float()
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
