"""The one-row INT4 GEMV (ops/w4a16_row_triton.py) against tinygemm and the split-K Triton GEMV at the decode
shapes of Flash-Next and Qwen3-Next: correct, then µs a call L2-cold (a rotation of weight copies past the L2 in one
CUDA graph, gpu_w4a16.cold_us) and L2-warm (one weight repeated), with a sweep of the row kernel's launches.

    python3 scripts/gpu_w4a16_row.py [--quick]

Exits non-zero when the row kernel disagrees with the reference (bf16: 1e-2 of the largest output; the fp32 row
must be within 1e-5).
"""
from __future__ import annotations

import argparse
import sys

import torch

from gpu_w4a16 import BOUND, COPY_CEILING, copies, cold_us, make_weight, nbytes, rel_err, weight_bytes

SHAPES = [("fn.gdn.in_proj_qkv|z", 16384, 2560), ("fn.attn.q|k|v", 13312, 2560), ("fn.out_proj", 2560, 6144),
          ("fn.shared.gate|up", 1280, 2560), ("fn.shared.down_proj", 2560, 640),
          ("q3n.gdn.qkv|z", 12288, 2048), ("q3n.out_proj", 2048, 4096), ("q3n.shared.gate|up", 1024, 2048),
          ("q3n.shared.down", 2048, 512)]


# RowConfig fields of the sweep: (block_n, groups, warps, stages) — 1 to 4 columns a thread
SWEEP_FIELDS = [(512, 1, 4, 2), (512, 2, 4, 2), (512, 2, 8, 2), (512, 4, 8, 2), (512, 5, 8, 3), (1024, 2, 8, 2),
                (1024, 4, 8, 2), (256, 2, 4, 2), (256, 4, 4, 2), (256, 5, 4, 3), (128, 2, 4, 2), (128, 4, 4, 2)]


def warm_us(call, reps=50):
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


def main() -> int:
    from flashnext.ops import w4a16_triton as split_gemv
    from flashnext.ops.w4a16 import w4a16_linear_reference
    from flashnext.ops.w4a16_row_triton import RowConfig, row_config, w4a16_row
    from flashnext.ops.w4a16_tinygemm import tinygemm_matmul, to_tinygemm

    sweep = [RowConfig(*fields) for fields in SWEEP_FIELDS]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="no sweep of the row kernel's launches")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':22} {'path':26} {'err':>8} {'cold us':>8} {'warm us':>8} {'%ceil':>6}")
    failures = 0
    for name, n, k in SHAPES:
        for kind in ("sym",):
            w = make_weight(n, k, kind, dev, gen)
            rotation = copies(w, weight_bytes(w))
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            ref = w4a16_linear_reference(x, w)
            size = nbytes(w, 1, k, n)
            x32 = x.float()
            err32 = rel_err(w4a16_row(x32, w), w4a16_linear_reference(x32, w))
            failures += not err32 < 1e-5

            def show(path, fn, err):
                cold, _ = cold_us(fn, rotation)
                warm = warm_us(lambda: fn(rotation[0]))
                print(f"{name:22} {path:26} {err:8.1e} {cold:8.2f} {warm:8.2f} "
                      f"{100 * size / cold / 1e3 * 1e9 / COPY_CEILING:5.1f}%")
                return cold

            tw = [to_tinygemm(v, 8) for v in rotation]
            tiny = {id(v): t for v, t in zip(rotation, tw)}
            show(f"tinygemm ({kind})", lambda v: tinygemm_matmul(x, tiny[id(v)]), rel_err(tinygemm_matmul(x, tw[0]), ref))

            show("triton split-K", lambda v: split_gemv.w4a16_matmul(x, v), rel_err(split_gemv.w4a16_matmul(x, w), ref))
            cfg = row_config(n, k, w.group_size, dev)
            err = rel_err(w4a16_row(x, w), ref)
            failures += not err < BOUND
            best = (show(f"row {cfg.block_n}x{cfg.groups} w{cfg.num_warps} (default)", lambda v: w4a16_row(x, v), err),
                    cfg)
            print(f"{'':22} {'':26} fp32 row err {err32:.1e}")
            del tw, tiny
            if not args.quick and kind == "sym" and name.startswith("fn."):
                for trial in sweep:
                    if trial == cfg:
                        continue
                    try:
                        got = w4a16_row(x, w, trial)
                        failures += not rel_err(got, ref) < BOUND
                        t, _ = cold_us(lambda v: w4a16_row(x, v, trial), rotation)
                    except Exception as error:  # noqa: BLE001 - a launch that does not fit is reported
                        print(f"{name:22} row {trial}: {type(error).__name__} {str(error)[:80]}")
                        continue
                    label = f"row {trial.block_n}x{trial.groups} w{trial.num_warps} s{trial.num_stages}"
                    print(f"{name:22} {label:26} {'':8} {t:8.2f}")
                    best = min(best, (t, trial), key=lambda b: b[0])
                print(f"{name:22} best row: {best[1]} {best[0]:.2f} us cold")
            del rotation
            torch.cuda.empty_cache()
    print("ALL CORRECT" if not failures else f"{failures} MISMATCH(ES)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
