"""On the GPU machine: the Triton prefill attention (ops/prefill_attention_triton.py) against its torch reference
at Flash-Next / Qwen3-Next shapes in bf16 (dense causal and with a QSA block selection), timed against the
reference (SDPA over gathered rows), with a few tile configurations. Exits non-zero on a mismatch.
Run: python3 scripts/gpu_prefill_attention.py [--quick]   (--quick: the two configs the defaults come from, no
crossover table)"""
import sys
import time

import torch

from flashnext.ops.prefill_attention import prefill_attention_reference
from flashnext.ops.prefill_attention_triton import PrefillConfig, default_config, prefill_attention_triton

CONFIGS = [PrefillConfig(64, 64, 8, 2), PrefillConfig(64, 32, 4, 2), PrefillConfig(128, 64, 8, 2),
           PrefillConfig(128, 64, 8, 3), PrefillConfig(64, 64, 4, 3), PrefillConfig(64, 64, 4, 4),
           PrefillConfig(128, 32, 8, 3), PrefillConfig(128, 32, 8, 4), PrefillConfig(64, 64, 8, 3)]
QUICK_CONFIGS = [PrefillConfig(64, 32, 4, 2), PrefillConfig(128, 64, 8, 3)]   # the default and the one it replaced


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def case(context, length, heads, kv_heads, dim, ratio, topk_blocks, page=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = context + length
    pages = -(-total // page) + 4
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    c = dict(q=torch.randn(length, heads, dim, **kw), k_cache=torch.randn(pages, page, kv_heads, dim, **kw),
             v_cache=torch.randn(pages, page, kv_heads, dim, **kw),
             blocks=torch.randperm(pages, device="cuda", generator=g)[: -(-total // page)],
             context_len=context, scale=dim ** -0.5)
    if ratio:
        pos = context + torch.arange(length, device="cuda")
        nblk = total // ratio
        complete = ((pos + 1) // ratio)[:, None]
        scores = torch.rand(length, nblk, device="cuda", generator=g).masked_fill(
            torch.arange(nblk, device="cuda")[None, :] >= complete, -1)
        top = scores.topk(min(topk_blocks, nblk), dim=-1).indices
        chosen = torch.zeros(length, nblk, dtype=torch.bool, device="cuda").scatter_(1, top, True)
        c.update(chosen=chosen & (torch.arange(nblk, device="cuda")[None, :] < complete), ratio=ratio)
    return c


def crossover(length=2048, heads=24, kv=2, dim=256, ratio=4, topk=512):
    """Flash-Next QSA prefill of `length` queries after growing contexts: the flash kernel over every earlier key
    with the block selection as a mask, against token lists through the paged decode kernel (one row per query,
    ≤ 2,051 keys each). IndexedAttention switches to lists past SPARSE_PREFILL_BUDGETS × budget tokens."""
    from flashnext.models.layers.qsa_indexer import SPARSE_PREFILL_BUDGETS
    from flashnext.ops.decode_attention import decode_attention

    print(f"\nQSA prefill, {length} queries: flash+mask vs token lists (lists used past "
          f"{SPARSE_PREFILL_BUDGETS * topk * ratio} tokens)")
    print(f"{'context':>8} {'flash ms':>9} {'lists ms':>9} {'lists vs flash':>14}")
    for context in (4096, 8192, 16384, 32768, 65536):
        c = case(context, length, heads, kv, dim, ratio, topk)
        flash = timed(lambda: prefill_attention_triton(**c))
        pos = context + torch.arange(length, device="cuda")
        chosen = c["chosen"]
        # the token lists the indexer would give: chosen blocks' tokens, then the tail of the incomplete block
        picks = chosen.nonzero()
        per = chosen.sum(1).max().item()
        index = torch.zeros(length, per * ratio + ratio - 1, dtype=torch.long, device="cuda")
        valid = torch.zeros_like(index, dtype=torch.bool)
        order = torch.cumsum(chosen.int(), 1) - 1
        slot = order[picks[:, 0], picks[:, 1]]
        for r in range(ratio):
            index[picks[:, 0], slot * ratio + r] = picks[:, 1] * ratio + r
            valid[picks[:, 0], slot * ratio + r] = True
        tail = ((pos + 1) // ratio * ratio)[:, None] + torch.arange(ratio - 1, device="cuda")
        index[:, per * ratio:] = tail.clamp(max=context + length - 1)
        valid[:, per * ratio:] = tail <= pos[:, None]
        k_pages, v_pages = c["k_cache"], c["v_cache"]
        table = c["blocks"][None, :].expand(length, -1)
        run_lists = lambda: decode_attention(c["q"], k_pages, v_pages, table, pos + 1, c["scale"],  # noqa: E731
                                             token_index=index, token_valid=valid)
        a, b = run_lists().float(), prefill_attention_triton(**c).float()
        err = ((a - b).abs().max() / b.abs().max()).item()
        print(f"{context:8} {flash:9.2f} {timed(run_lists):9.2f} {err:14.1e}")


def main() -> int:
    quick = "--quick" in sys.argv
    ok = True
    shapes = [("flash-next qsa", 8192, 2048, 24, 2, 256, 4, 512), ("flash-next qsa", 0, 8192, 24, 2, 256, 4, 512),
              ("qwen3-next", 0, 8192, 16, 2, 256, None, 0), ("qwen3-next", 81920, 8192, 16, 2, 256, None, 0)]
    print(f"{'shape':16} {'context':>7} {'T':>5} {'err':>8} {'ref ms':>8} {'ours ms':>8} {'TFLOP/s':>8}  best config")
    for name, context, length, heads, kv, dim, ratio, topk in shapes:
        c = case(context, length, heads, kv, dim, ratio, topk)
        got = prefill_attention_triton(**c)
        want = prefill_attention_reference(**c) if context + length <= 20000 else None
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() if want is not None else float("nan")
        ok &= want is None or err < 2e-2
        ref_ms = timed(lambda: prefill_attention_reference(**c), reps=2) if want is not None else float("nan")
        times = {}
        for cfg in (QUICK_CONFIGS if quick else CONFIGS):
            try:
                times[cfg] = timed(lambda: prefill_attention_triton(**c, config=cfg))
            except Exception as e:  # a config that does not fit in shared memory
                print(f"    {cfg}: {type(e).__name__}")
        ours = timed(lambda: prefill_attention_triton(**c))
        best = min(times, key=times.get) if times else None
        # causal work: Σ over queries of visible keys (dense) × heads × D × 4 FLOP
        keys = length * context + length * (length + 1) / 2
        tflops = keys * heads * dim * 4 / (ours * 1e-3) / 1e12
        print(f"{name:16} {context:7} {length:5} {err:8.1e} {ref_ms:8.2f} {ours:8.2f} {tflops:8.1f}  "
              f"default {default_config(dim, got.device)}; best {best} "
              f"{times.get(best, float('nan')):.2f} ms")
    if not quick:
        crossover()
    print("ALL CORRECT" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
