"""On the GPU machine: the INT4 MoE kernels at the real shapes — correct against the torch reference, and how
fast (decode M = 1, 2, 4, 8; prefill M = 4096), with a small sweep of tile configs.

Flash-Next (H 2560, I 640) and Qwen3-Next (H 2048, I 512): E 512, top-10, g 128, symmetric (plus one
asymmetric correctness check). Routing comes from a random zero-mean router on random activations, so
tokens spread over the experts (PERF.md: positive-only weights collapse routing); the coverage is printed.
Bandwidth = bytes of expert weights read (qweight + scales of every distinct routed expert) / time, against
the 4.27 TB/s copy ceiling. Times are triton.testing.do_bench medians (L2 flushed before each call);
decode also replayed in a CUDA graph over 8 layers' distinct weights (per-layer µs), as the engine runs it. Exits non-zero on a mismatch.
Run: python3 scripts/gpu_moe.py [--quick]
"""
import sys

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from flashnext.ops.moe_int4 import moe_int4_reference
from flashnext.ops.moe_int4_triton import DECODE, PREFILL, MoeConfig, moe_int4_triton
from flashnext.weights.int4_layout import Int4Weight

CEILING = 4.27e12
SHAPES = {"flash-next": (2560, 640), "qwen3-next": (2048, 512)}
E, TOP_K, G = 512, 10, 128
DECODE_M, PREFILL_M = (1, 2, 4, 8), 4096
LAYERS = 8
DECODE_SWEEP = [DECODE] + [MoeConfig(16, bn, bk, w, s) for bn, bk, w, s in
                           [(16, 128, 4, 3), (64, 128, 4, 3), (32, 64, 4, 4), (64, 64, 4, 4), (32, 128, 2, 3),
                            (64, 128, 8, 3), (128, 128, 4, 3), (32, 256, 4, 2)]]
PREFILL_SWEEP = [PREFILL] + [MoeConfig(bm, bn, bk, w, s) for bm, bn, bk, w, s in
                             [(64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 128, 128, 8, 3), (128, 64, 64, 4, 4),
                              (32, 128, 64, 4, 4), (128, 128, 128, 8, 2)]]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_experts(n, k, asym=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31 - 1, (E, k // 8, n), generator=g, device="cuda", dtype=torch.int32)
    # Zero-mean, signed scales sized so that activations stay O(1) through gate/up and down.
    scales = (torch.randn(E, k // G, n, generator=g, device="cuda") / (4.6 * k ** 0.5)).to(torch.bfloat16)
    zeros = torch.randint(0, 17, (E, k // G, n), generator=g, device="cuda").to(torch.uint8) if asym else None
    return Int4Weight(qweight, scales, zeros, None, G)


def routing(m, h, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, h, generator=g, device="cuda").to(torch.bfloat16)
    router = torch.randn(E, h, generator=g, device="cuda") / h ** 0.5
    top, ids = torch.topk(torch.softmax(x.float() @ router.t(), -1), TOP_K, dim=-1)
    return x, ids, (top / top.sum(-1, keepdim=True)).to(torch.bfloat16)


def weight_bytes(w: Int4Weight, experts: int) -> int:
    per_expert = sum(t[0].numel() * t.element_size() for t in w.tensors().values())
    return per_expert * experts


def check(name, h, i) -> bool:
    ok = True
    for asym in (False, True):
        wgu, wd = random_experts(2 * i, h, asym, 0), random_experts(h, i, asym, 1)
        for m in (1, 8, 300):
            x, ids, w = routing(m, h, seed=m)
            ref = moe_int4_reference(x.float(), ids, w, wgu, wd)
            e16 = rel(moe_int4_triton(x, ids, w, wgu, wd), ref)
            e32 = rel(moe_int4_triton(x.float(), ids, w, wgu, wd), ref)
            # bf16: x and the intermediate h are bf16 (as in the bf16 model); fp32: exact but summation order.
            good = e16 < 2e-2 and e32 < 1e-4
            ok &= good
            print(f"  check {name:10} {'asym' if asym else 'sym ':4} M={m:<4} bf16 {e16:.2e}  fp32 {e32:.2e}  "
                  f"{'ok' if good else 'MISMATCH'}")
    return ok


def bench(name, h, i, quick):
    # LAYERS distinct weight sets: the CUDA-graph replay runs them in turn, as a decode step runs its layers,
    # so 10 experts' 25 MB cannot stay in the 50 MB L2 from one replay to the next.
    layers = [(random_experts(2 * i, h, seed=2 * n), random_experts(h, i, seed=2 * n + 1)) for n in range(LAYERS)]
    wgu, wd = layers[0]
    print(f"\n{name}: H={h} I={i} E={E} top-{TOP_K} g{G} — per layer, routed experts only")
    print(f"  {'M':>5} {'experts':>7} {'MB read':>8} {'config':>22} {'µs (bench)':>10} {'µs (graph)':>10} "
          f"{'GB/s':>7} {'% ceil':>6} {'TFLOP/s':>8}")
    for m in DECODE_M + (PREFILL_M,):
        x, ids, w = routing(m, h, seed=m)
        experts = ids.unique().numel()
        nbytes = weight_bytes(wgu, experts) + weight_bytes(wd, experts)
        flops = 2 * m * TOP_K * 3 * h * i
        sweep = DECODE_SWEEP if m <= 16 else PREFILL_SWEEP
        results = []
        for cfg in (sweep[:1] if quick else sweep):
            fn = lambda: moe_int4_triton(x, ids, w, wgu, wd, cfg)  # noqa: E731
            step = lambda: [moe_int4_triton(x, ids, w, a, b, cfg) for a, b in layers]  # noqa: E731
            try:
                t = do_bench(fn, warmup=10, rep=50) * 1e-3
                tg = do_bench_cudagraph(step, rep=50) * 1e-3 / LAYERS if m <= 16 else float("nan")
            except Exception as exc:  # a config that does not compile (shared memory, registers): skip it
                print(f"  {m:5d} {'':7} {'':8} {_cfg(cfg):>22} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            results.append((min(t, tg) if m <= 16 else t, t, tg, cfg))
        for best, (_, t, tg, cfg) in enumerate(sorted(results, key=lambda r: r[0])):
            tt = min(t, tg) if m <= 16 else t
            print(f"  {m:5d} {experts:7d} {nbytes / 1e6:8.1f} {_cfg(cfg):>22} {t * 1e6:10.1f} {tg * 1e6:10.1f} "
                  f"{nbytes / tt / 1e9:7.0f} {100 * nbytes / tt / CEILING:5.1f}% {flops / tt / 1e12:8.1f}"
                  f"{'  <- best' if best == 0 and len(results) > 1 else ''}")


def _cfg(c: MoeConfig) -> str:
    return f"m{c.block_m} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"


def main() -> int:
    quick = "--quick" in sys.argv
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    ok = all([check(name, h, i) for name, (h, i) in SHAPES.items()])
    for name, (h, i) in SHAPES.items():
        bench(name, h, i, quick)
    print("\nall checks passed" if ok else "\nMISMATCH: see the check lines above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
