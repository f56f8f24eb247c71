"""On the GPU machine: the Triton prefill attention (ops/prefill_attention_triton.py) against its torch reference
at Flash-Next / Qwen3-Next shapes in bf16 (dense causal and with a QSA block selection), timed against the
reference (SDPA over gathered rows), with a few tile configurations. Exits non-zero on a mismatch.
Run: python3 scripts/gpu_prefill_attention.py"""
import sys
import time

import torch

from flashnext.ops.prefill_attention import prefill_attention_reference
from flashnext.ops.prefill_attention_triton import PrefillConfig, default_config, prefill_attention_triton

CONFIGS = [PrefillConfig(64, 64, 8, 2), PrefillConfig(64, 32, 4, 2), PrefillConfig(128, 64, 8, 2),
           PrefillConfig(64, 64, 4, 3), PrefillConfig(128, 32, 8, 3)]


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


def main() -> int:
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
        for cfg in CONFIGS:
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
              f"default {default_config(dim, got.device)}; best {best} {times.get(best, float('nan')):.2f} ms")
    print("ALL CORRECT" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
