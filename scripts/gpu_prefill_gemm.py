"""On the GPU machine: the INT4 GEMMs of prefill at Flash-Next shapes — the dense W4A16 kernel (w4a16_triton
`_w4a16_kernel`) and the grouped MoE kernels (moe_int4_triton) — over tile configurations, with the group scale
applied to the fp32 partial or to the weight tile before the dot (scale_in_tile), checked against the torch
reference and timed against bf16 cuBLAS on the dequantised weight (dense) or the matmul FLOPs (MoE), and the dense
dequantise-then-cuBLAS path (the default from 256 rows). Prints the best config per shape.
Run: python3 scripts/gpu_prefill_gemm.py [--m 8192] [--dense-only-m 512 ...]   (the second: no sweep, the GEMM
kernel's default tiles against dequantise-then-cuBLAS at that M: where the dequantised path starts to pay)"""
import argparse
import itertools
import sys

import torch
from triton.testing import do_bench

from flashnext.ops.int4_dequant_triton import dequantize_triton
from flashnext.ops.moe_int4 import moe_int4_reference
from flashnext.ops.moe_int4_triton import PREFILL, MoeConfig, moe_int4_triton
from flashnext.ops.w4a16 import w4a16_linear_reference
from flashnext.ops.w4a16_triton import LaunchConfig, default_config, w4a16_matmul
from flashnext.weights.int4_layout import quantize_rtn
from gpu_common import rel
from gpu_moe import random_experts, routing

DENSE = [(10240, 2560), (2560, 6144), (12288, 2560), (6144, 2560)]
TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3),
         (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (256, 128, 64, 8, 3)]
MOE_TILES = [(64, 128, 64, 8, 3), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 128, 128, 8, 3), (128, 64, 64, 4, 4),
             (64, 256, 64, 8, 3), (32, 128, 64, 4, 4), (64, 64, 128, 4, 4), (64, 64, 64, 4, 5)]


class WrongResult(Exception):
    """A config's result differs from the reference."""


def expect(good: bool, what: str) -> None:
    if not good:
        raise WrongResult(what)


def dense(m, sweep=True):
    """Per Flash-Next shape: bf16 cuBLAS, dequantise-then-cuBLAS (the default from DEQUANT_MIN_M rows), the GEMM
    kernel's default tiles, and (sweep) its best of TILES with and without the scale in the tile."""
    print(f"dense W4A16, M={m}, bf16, g128 sym")
    print(f"{'N':>6} {'K':>6} {'cuBLAS bf16 us':>14} {'dequant+cuBLAS us':>17} {'dequant us':>10} {'kernel us':>10} "
          f"{'best us':>8} {'best TFLOP/s':>12}  best config")
    for n, k in DENSE:
        w = quantize_rtn(torch.randn(n, k, device="cuda") / k ** 0.5)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        dense_w = w4a16_linear_reference(torch.eye(k, device="cuda", dtype=torch.bfloat16), w).t().contiguous()
        ref = x @ dense_w.t()
        cublas = do_bench(lambda: x @ dense_w.t()) * 1e3
        kernel = default_config(m, n, k, w.group_size, x.device)
        times = {}
        swept = [LaunchConfig(bm, bn, bk, 1, warps, stages, in_tile)
                 for (bm, bn, bk, warps, stages), in_tile in itertools.product(TILES, (False, True))]
        for cfg in [kernel] + (swept if sweep else []):
            try:
                got = w4a16_matmul(x, w, cfg)
                expect(rel(got, ref) < 1e-2, f"{cfg}: err {rel(got, ref):.2e}")
                times[cfg] = do_bench(lambda: w4a16_matmul(x, w, cfg)) * 1e3
            except WrongResult:   # a failure, not a config to skip
                raise
            except Exception as exc:  # shared memory or registers exceeded
                print(f"    skip {cfg}: {type(exc).__name__} {str(exc)[:80]}")
        err = rel(x @ dequantize_triton(w, x.dtype), ref)
        assert err < 1e-2, err
        t_dequant = do_bench(lambda: dequantize_triton(w, x.dtype)) * 1e3
        t_both = do_bench(lambda: x @ dequantize_triton(w, x.dtype)) * 1e3
        best = min(times, key=times.get)
        print(f"{n:6} {k:6} {cublas:14.1f} {t_both:17.1f} {t_dequant:10.1f} {times.get(kernel, float('nan')):10.1f} "
              f"{times[best]:8.1f} {2 * m * n * k / times[best] / 1e6:12.1f}  {best}  (dequant path err {err:.1e})")
        for cfg, t in sorted(times.items(), key=lambda kv: kv[1])[1:4] if sweep else []:
            print(f"        {t:8.1f} us  {cfg}")


def moe(m):
    h, i = 2560, 640
    print(f"\nMoE grouped INT4, M={m} tokens, top-10 of 512, H={h} I={i}, bf16")
    wgu, wd = random_experts(2 * i, h, seed=0), random_experts(h, i, seed=1)
    x, ids, w = routing(m, h, seed=3)
    ref = moe_int4_reference(x.float(), ids, w, wgu, wd)
    flops = 2 * m * 10 * 3 * h * i
    times = {}
    for (bm, bn, bk, warps, stages), in_tile in itertools.product(MOE_TILES, (False, True)):
        cfg = MoeConfig(bm, bn, bk, warps, stages, in_tile)
        try:
            got = moe_int4_triton(x, ids, w, wgu, wd, cfg)
            expect(rel(got, ref) < 2e-2, f"{cfg}: err {rel(got, ref):.2e}")
            times[cfg] = do_bench(lambda: moe_int4_triton(x, ids, w, wgu, wd, cfg)) * 1e3
        except WrongResult:
            raise
        except Exception as exc:
            print(f"    skip {cfg}: {type(exc).__name__} {str(exc)[:80]}")
    for cfg, t in sorted(times.items(), key=lambda kv: kv[1])[:10]:
        print(f"  {t:9.1f} us {flops / t / 1e6:7.1f} TFLOP/s  {cfg}{'  (default)' if cfg == PREFILL else ''}")
    print(f"  default {PREFILL}: {times.get(PREFILL, float('nan')):.1f} us")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, action="append", default=[])
    ap.add_argument("--dense-only-m", type=int, action="append", default=[])
    args = ap.parse_args()
    for m in args.dense_only_m:
        dense(m, sweep=False)
    for m in args.m or ([] if args.dense_only_m else [8192]):
        dense(m)
        moe(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
