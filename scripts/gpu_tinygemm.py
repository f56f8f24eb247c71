"""PyTorch's own INT4 GEMV (tinygemm: torch.ops.aten._weight_int4pack_mm, bf16 activations, g128 scales and
zeros) against our Triton GEMV kernel (ops/w4a16_triton.py) and bf16 cuBLAS, L2-cold, at the Flash-Next decode
shapes: is a library kernel better for the dense INT4 projections of decode?

    python3 scripts/gpu_tinygemm.py

For each shape it converts a random RTN g128 symmetric weight from our kernel layout to tinygemm's with 2, 4 or
8 inner K tiles (ops/w4a16_tinygemm.py to_tinygemm, as the engine does at load), checks it against our
reference, and times each kernel in one CUDA graph over a rotation of weight copies larger than the L2 cache
(gpu_w4a16.cold_us). Exits non-zero when tinygemm disagrees with the reference.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from gpu_w4a16 import BOUND, COPY_CEILING, copies, cold_us, make_weight, nbytes, rel_err, weight_bytes

SHAPES = [("fn.gdn.in_proj_qkv|z", 16384, 2560), ("fn.attn.q|k|v", 13312, 2560), ("fn.gdn.out_proj", 2560, 6144),
          ("fn.shared.gate|up", 1280, 2560), ("fn.shared.down_proj", 2560, 640)]
ROWS = [1, 2, 4, 8]


def main() -> int:
    from flashnext.ops import w4a16_triton as kernels
    from flashnext.ops.w4a16 import w4a16_linear_reference
    from flashnext.ops.w4a16_tinygemm import tinygemm_matmul, to_tinygemm
    from flashnext.weights.int4_layout import dequantize

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':22} {'M':>2} {'path':10} {'err':>8} {'cold us':>8} {'GB/s':>6} {'%ceil':>6}")
    failures = 0
    for name, n, k in SHAPES:
        w = make_weight(n, k, "sym", dev, gen)
        rotation = copies(w, weight_bytes(w))
        dense = dequantize(w).to(torch.bfloat16)
        dense_rotation = copies(dense, dense.numel() * 2)
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = w4a16_linear_reference(x, w)
            size = nbytes(w, m, k, n)
            t, _ = cold_us(lambda v: kernels.w4a16_matmul(x, v), rotation)
            print(f"{name:22} {m:2d} {'triton':10} {rel_err(kernels.w4a16_matmul(x, w), ref):8.1e} {t:8.2f} "
                  f"{size / t / 1e3:6.0f} {100 * size / t / 1e3 * 1e9 / COPY_CEILING:5.1f}%")
            for tiles in (2, 4, 8):
                try:
                    tw = [to_tinygemm(v, tiles) for v in rotation]
                    err = rel_err(tinygemm_matmul(x, tw[0]), ref)
                    failures += not err < BOUND
                    t, _ = cold_us(lambda v: tinygemm_matmul(x, v), tw)
                except Exception as error:  # noqa: BLE001 - an unsupported tiling is reported, not fatal
                    print(f"{name:22} {m:2d} tiny k{tiles}    FAILED: {type(error).__name__}: {str(error)[:150]}")
                    continue
                print(f"{name:22} {m:2d} {'tiny k' + str(tiles):10} {err:8.1e} {t:8.2f} {size / t / 1e3:6.0f} "
                      f"{100 * size / t / 1e3 * 1e9 / COPY_CEILING:5.1f}%")
                del tw
            t, _ = cold_us(lambda d: F.linear(x, d), dense_rotation)
            print(f"{name:22} {m:2d} {'bf16':10} {'':8} {t:8.2f} {dense.numel() * 2 / t / 1e3:6.0f} "
                  f"{100 * dense.numel() * 2 / t / 1e3 * 1e9 / COPY_CEILING:5.1f}%")
        del rotation, dense_rotation
        torch.cuda.empty_cache()
    print("ALL CORRECT" if not failures else f"{failures} MISMATCH(ES)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
