"""W4A16 kernels on the GPU: correctness against the torch reference and timings at real model shapes.

    python scripts/gpu_w4a16.py            # full table (~1-2 min on an H200)
    python scripts/gpu_w4a16.py --quick    # fewer shapes, no sweep

For each (layer, M) it checks the Triton result against w4a16_linear_reference (bf16 out, fp32 math), then
times it with triton.testing.do_bench (eager launches) and do_bench_cudagraph (one kernel replayed in a
graph: the decode engine's situation). Bytes = packed weight + scales (+ zeros) + x + y; GB/s is compared
with the 4.27 TB/s device-to-device copy ceiling (PERF.md). Baselines: torch bf16 F.linear on the
dequantised weight (what we would read without INT4). For decode shapes a small sweep of launch configs
reports the best one next to the default heuristic.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

COPY_CEILING = 4.27e12
# (name, N, K) of Qwen3.8-Flash-Next (hidden 2560) and Qwen3-Next-80B-A3B (hidden 2048)
SHAPES = [
    ("fn.gdn.in_proj_qkv", 10240, 2560),
    ("fn.gdn.in_proj_z", 6144, 2560),
    ("fn.gdn.out_proj", 2560, 6144),
    ("fn.attn.q_proj", 12288, 2560),
    ("fn.attn.k_proj", 512, 2560),
    ("fn.attn.o_proj", 2560, 6144),
    ("fn.shared.gate_proj", 640, 2560),
    ("fn.shared.down_proj", 2560, 640),
    ("q3n.gdn.in_proj_qkvz", 12288, 2048),
    ("q3n.gdn.out_proj", 2048, 4096),
]
DECODE_M = [1, 4, 16]
PREFILL_M = [256, 2048]


def make_weight(n, k, kind, device, gen):
    from flashnext.weights.int4 import quantize_gptq_rtn
    from flashnext.weights.int4_layout import from_gptq, quantize_rtn

    w = torch.randn(n, k, generator=gen, device="cpu")
    if kind == "sym":
        return quantize_rtn(w.to(device), 128)
    perm = torch.randperm(k, generator=gen)
    ckpt = quantize_gptq_rtn(w, 128, sym=False, desc_act_perm=perm)
    return from_gptq(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], sym=False).to(device)


def nbytes(w, m, k, n):
    return sum(t.numel() * t.element_size() for t in w.tensors().values()) + 2 * m * k + 2 * m * n


def bench(fn):
    import triton.testing as tt

    eager = tt.do_bench(fn, warmup=25, rep=100)
    try:
        graph = tt.do_bench_cudagraph(fn, rep=100)
    except Exception:  # noqa: BLE001 - a capture failure is reported, not fatal
        graph = float("nan")
    return eager, graph


def sweep(x, w, kernels):
    """Best decode config among a few (block_n, block_k, split_k, warps), timed in a CUDA graph."""
    import triton.testing as tt

    best = None
    for block_n in (32, 64, 128):
        for block_k in (64, 128):
            for split in (1, 2, 4, 8, 16):
                for warps in (4,):
                    if block_k > w.group_size or (w.in_features // block_k) < split:
                        continue
                    cfg = kernels.LaunchConfig(kernels.triton.next_power_of_2(x.shape[0]) if x.shape[0] <= 4 else 16,
                                               block_n, block_k, split, warps, 4)
                    try:
                        t = tt.do_bench_cudagraph(lambda: kernels.w4a16_matmul(x, w, cfg), rep=30)
                    except Exception:  # noqa: BLE001 - configs that do not compile are skipped
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
    return best


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from flashnext.ops import w4a16_triton as kernels
    from flashnext.ops.w4a16 import w4a16_linear_reference
    from flashnext.weights.int4_layout import dequantize

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {kernels.triton.__version__}")
    shapes = SHAPES[:4] + SHAPES[6:8] if args.quick else SHAPES
    ms = DECODE_M + PREFILL_M
    header = (f"{'layer':22} {'kind':5} {'M':>5} {'N':>6} {'K':>5} {'err':>8} {'eager us':>9} {'graph us':>9} "
              f"{'GB/s':>7} {'%ceil':>6} {'TFLOP/s':>8} {'bf16 us':>8} {'x bf16':>7}  config")
    print(header)
    print("-" * len(header))
    failures = 0
    best_rows = []
    for name, n, k in shapes:
        for kind in ("sym",) if args.quick else ("sym", "act"):
            w = make_weight(n, k, kind, dev, gen)
            dense = dequantize(w).to(torch.bfloat16)
            for m in ms:
                if kind == "act" and m not in (1, 2048):
                    continue
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                try:
                    got = kernels.w4a16_matmul(x, w)
                    ref = w4a16_linear_reference(x, w)
                    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    ok = err < 1e-2
                    failures += not ok
                    eager, graph = bench(lambda: kernels.w4a16_matmul(x, w))
                    base, _ = bench(lambda: F.linear(x, dense))
                except Exception as error:  # noqa: BLE001 - one broken shape must not hide the others
                    failures += 1
                    print(f"{name:22} {kind:5} {m:5d} {n:6d} {k:5d}  FAILED: {type(error).__name__}: {error}")
                    continue
                t = graph if graph == graph else eager
                gbs = nbytes(w, m, k, n) / (t * 1e-3) / 1e9
                tflops = 2 * m * n * k / (t * 1e-3) / 1e12
                cfg = kernels.default_config(m, n, k, w.group_size, dev)
                print(f"{name:22} {kind:5} {m:5d} {n:6d} {k:5d} {err:8.1e}{'' if ok else '!'} {eager * 1e3:9.1f} "
                      f"{graph * 1e3:9.1f} {gbs:7.0f} {100 * gbs * 1e9 / COPY_CEILING:5.1f}% {tflops:8.1f} "
                      f"{base * 1e3:8.1f} {base / t:6.2f}x  bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k} "
                      f"split{cfg.split_k} w{cfg.num_warps}")
                if m in (1, 16) and kind == "sym" and not args.quick:
                    best = sweep(x, w, kernels)
                    if best:
                        best_rows.append((name, m, n, k, t, best, nbytes(w, m, k, n)))
    if best_rows:
        print("\ndecode sweep (CUDA graph): default vs best config")
        for name, m, n, k, t, (bt, cfg), nb in best_rows:
            print(f"{name:22} M={m:2d} default {t * 1e3:6.1f} us  best {bt * 1e3:6.1f} us "
                  f"({nb / (bt * 1e-3) / 1e9:5.0f} GB/s)  bn{cfg.block_n} bk{cfg.block_k} split{cfg.split_k} "
                  f"w{cfg.num_warps}")
    print(f"\n{'ALL CORRECT' if not failures else f'{failures} FAILURE(S)'} (err = max|triton - reference| / max|reference|, "
          "bound 1e-2 for bf16 output)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
