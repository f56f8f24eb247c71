"""W4A16 kernels on the GPU: correctness against the torch reference and timings at real model shapes.

    python scripts/gpu_w4a16.py                  # full table + decode config sweep at M = 1 and 8 (~1.5 min)
    python scripts/gpu_w4a16.py --quick          # fewer shapes, no sweep (unless --sweep-m), no prefill
    python scripts/gpu_w4a16.py --sweep-m 1,2,4,8

Decode rows (M = 1, 2, 4, 8) compare three things: `gemv` (w4a16_matmul's default: the GEMV kernel),
`old` (the GEMM kernel with its own decode config: what decode ran before the GEMV kernel) and `bf16`
(torch F.linear on the dequantised weight: what we would read without INT4). Each is timed three ways:
- cold: one CUDA graph that calls it on a rotation of weight copies larger than the L2 cache, as in a
  decode step where every weight comes from HBM (the number that matters; GB/s and % of the 4.27 TB/s
  copy ceiling are computed from it);
- graph: triton.testing.do_bench_cudagraph, the same weight replayed (L2-resident when it fits: 50 MB);
- eager: triton.testing.do_bench (L2 flushed before each call; includes no launch gap).
Bytes = packed weight + scales (+ zeros) + x + y. GEMM rows (M = 16, 64: split-K; 256, 2048: prefill) check and time the GEMM kernel
(its "cold" column is the L2-flushed eager time, and a TFLOP/s line follows).
The sweep times GEMV configs (block_n, block_k, split, fma/dot, warps; then stages for the best) cold, checks
each against the reference, and prints the best per shape as entries for w4a16_triton.TUNED.
Exit status 1 on any mismatch (max|y - reference| / max|reference| >= 1e-2, bf16 output) or failure.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from flashnext.ops.device import num_sms

COPY_CEILING = 4.27e12
ROTATION_BYTES = 256 << 20  # weight copies per cold timing: > 5x the H200's 50 MB L2
# (name, N, K) of Qwen3.8-Flash-Next (hidden 2560) and Qwen3-Next-80B-A3B (hidden 2048)
SHAPES = [
    ("fn.gdn.in_proj_qkv|z", 16384, 2560),   # stacked as the decode step runs them (models/stacked.py)
    ("fn.attn.q|k|v", 13312, 2560),
    ("fn.shared.gate|up", 1280, 2560),
    ("fn.gdn.in_proj_qkv", 10240, 2560),
    ("fn.gdn.in_proj_z", 6144, 2560),
    ("fn.gdn.out_proj", 2560, 6144),
    ("fn.attn.q_proj", 12288, 2560),
    ("fn.attn.k_proj/v_proj", 512, 2560),
    ("fn.attn.o_proj", 2560, 6144),
    ("fn.shared.gate/up", 640, 2560),
    ("fn.shared.down_proj", 2560, 640),
    ("q3n.gdn.in_proj_qkvz", 12288, 2048),
    ("q3n.gdn.out_proj", 2048, 4096),
    ("q3n.shared.gate/up", 512, 2048),
    ("q3n.shared.down_proj", 2048, 512),
]
QUICK = {"fn.gdn.in_proj_qkv|z", "fn.gdn.out_proj", "fn.attn.q|k|v", "fn.shared.gate|up", "fn.shared.down_proj"}
DECODE_M = [1, 2, 4, 8]
PREFILL_M = [16, 64, 256, 2048]   # 16 and 64: the GEMM's split-K (9-255 rows), summed in the kernel
BOUND = 1e-2


def make_weight(n, k, kind, device, gen):
    from flashnext.weights.int4 import quantize_gptq_rtn
    from flashnext.weights.int4_layout import from_gptq, quantize_rtn

    w = torch.randn(n, k, generator=gen, device="cpu")
    if kind == "sym":
        return quantize_rtn(w.to(device), 128)
    perm = torch.randperm(k, generator=gen)
    ckpt = quantize_gptq_rtn(w, 128, sym=False, desc_act_perm=perm)
    return from_gptq(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], sym=False).to(device)


def weight_bytes(w):
    return sum(t.numel() * t.element_size() for t in w.tensors().values())


def nbytes(w, m, k, n):
    return weight_bytes(w) + 2 * m * k + 2 * m * n


def copies(w, size):
    """Enough clones of an Int4Weight (or a dense tensor) to overflow the L2 cache when read in turn."""
    from flashnext.weights.int4_layout import Int4Weight

    count = max(2, min(512, ROTATION_BYTES // size))
    if isinstance(w, torch.Tensor):
        return [w.clone() for _ in range(count)]
    return [Int4Weight(*(t.clone() if t is not None else None for t in (w.qweight, w.scales, w.zeros, w.perm)),
                       w.group_size) for _ in range(count)]


def cold_us(call, weights, replays=5):
    """µs per call of call(w) in one CUDA graph over a rotation of weights (each read from HBM)."""
    call(weights[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call(w) for w in weights]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(weights)), outs


def bench_us(fn):
    import triton.testing as tt

    eager = tt.do_bench(fn, warmup=5, rep=20) * 1e3
    try:
        graph = tt.do_bench_cudagraph(fn, rep=10) * 1e3
    except Exception:  # noqa: BLE001 - a capture failure is reported, not fatal
        graph = float("nan")
    return eager, graph


def rel_err(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def sweep_configs(kernels, m, n, k, group_size, device):
    """Candidate GEMV configs. Up to 4 rows: whole-share tiles (split = K / block_k, one tile per program) of
    each size, and the K-loop configs of before (128-row tiles, the heuristic's split, half and double it);
    8 rows: the tensor-core and FMA K-loop configs."""
    heuristic = kernels.gemv_config(m, n, k, group_size, device)
    seen = set()
    bucket = kernels.m_bucket(m)

    def fresh(cfg):
        if cfg not in seen:
            seen.add(cfg)
            return True
        return False

    if bucket <= 4:
        for block_k in (128, 256, 512, 1024):
            if k % block_k or block_k % group_size and group_size % block_k or block_k * bucket > 1024:
                continue
            for block_n in (32, 64, 128):
                for warps in (4, 8):
                    cfg = kernels.GemvConfig(block_n, block_k, k // block_k, False, warps, 1)
                    if fresh(cfg):
                        yield cfg
    for use_dot in (False, True):
        for block_n in (32, 64, 128, 256):
            if use_dot and bucket <= 2 and block_n != 128:  # M <= 2 idles 7/8 of each MMA: one tile to compare
                continue
            for block_k in (128,) if use_dot or bucket <= 2 else (64, 128):
                tiles = k // block_k
                base = max(1, -(-kernels.PROGRAMS_PER_SM * num_sms(device) // -(-n // block_n)))
                for split in sorted({max(1, base // 2), base, 2 * base}):
                    for warps in (4,) if block_n <= 32 else (4, 8):
                        cfg = kernels.GemvConfig(block_n, block_k, min(split, tiles), use_dot, warps, 3)
                        if fresh(cfg):
                            yield cfg
    if fresh(heuristic):
        yield heuristic


def sweep(kernels, x, w, rotation, ref):
    """(best µs, best config, failures): each config checked, then timed cold; stages tried on the best."""
    m, k = x.shape
    n = w.out_features
    best, failures = None, 0

    def trial(cfg):
        nonlocal best, failures
        try:
            if rel_err(kernels.w4a16_matmul(x, w, cfg), ref) >= BOUND:
                failures += 1
                print(f"  MISMATCH {cfg}")
                return
            t, _ = cold_us(lambda v: kernels.w4a16_matmul(x, v, cfg), rotation, replays=3)
        except Exception as error:  # noqa: BLE001 - a config that does not compile is reported and skipped
            print(f"  skipped {cfg}: {type(error).__name__}: {str(error)[:120]}")
            return
        if best is None or t < best[0]:
            best = (t, cfg)

    for cfg in sweep_configs(kernels, m, n, k, w.group_size, x.device):
        trial(cfg)
    if best is not None:
        for stages in (2, 4):
            c = best[1]
            trial(kernels.GemvConfig(c.block_n, c.block_k, c.split_k, c.use_dot, c.num_warps, stages))
    return best, failures


def fmt_cfg(c):
    if c is None:
        return ""
    if hasattr(c, "block_m"):  # LaunchConfig (GEMM kernel)
        return f"gemm bm{c.block_m} bn{c.block_n} bk{c.block_k} split{c.split_k} w{c.num_warps}"
    return (f"{'dot' if c.use_dot else 'fma'} bn{c.block_n} bk{c.block_k} split{c.split_k} w{c.num_warps} "
            f"s{c.num_stages}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep-m", default=None,
                        help="decode M values to sweep configs at ('' for none; default 1,8, none with --quick)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from flashnext.ops import w4a16_triton as kernels
    from flashnext.ops.w4a16 import w4a16_linear_reference
    from flashnext.weights.int4_layout import dequantize

    began = time.perf_counter()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {kernels.triton.__version__}  "
          f"{num_sms(dev)} SMs")
    shapes = [s for s in SHAPES if s[0] in QUICK] if args.quick else SHAPES
    if args.sweep_m is None:
        args.sweep_m = "" if args.quick else "1,8"
    sweep_m = [int(v) for v in args.sweep_m.split(",") if v]
    header = (f"{'layer':22} {'kind':4} {'M':>4} {'N':>6} {'K':>5} {'path':5} {'err':>8} {'cold us':>8} "
              f"{'graph us':>8} {'eager us':>8} {'GB/s':>6} {'%ceil':>6}  config")
    print(header)
    print("-" * len(header))
    failures = 0
    best_rows = []

    def row(name, kind, m, n, k, path, err, cold, graph, eager, nb, cfg):
        gbs = nb / (cold * 1e-6) / 1e9 if cold == cold else float("nan")
        flag = "" if err != err or err < BOUND else "!"
        print(f"{name:22} {kind:4} {m:4d} {n:6d} {k:5d} {path:5} {err:8.1e}{flag or ' '}{cold:8.2f} {graph:8.2f} "
              f"{eager:8.2f} {gbs:6.0f} {100 * gbs * 1e9 / COPY_CEILING:5.1f}%  {fmt_cfg(cfg)}")

    for name, n, k in shapes:
        for kind in ("sym",) if args.quick else ("sym", "act"):
            w = make_weight(n, k, kind, dev, gen)
            rotation = copies(w, weight_bytes(w))
            dense = dequantize(w).to(torch.bfloat16)
            dense_rotation = copies(dense, dense.numel() * 2) if kind == "sym" else None
            for m in DECODE_M + ([] if args.quick or kind == "act" else PREFILL_M):
                if kind == "act" and m not in (1, 8):
                    continue
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = w4a16_linear_reference(x, w)
                decode = m <= kernels.GEMV_MAX_M
                paths = [("gemv", None)] if decode else [("gemm", None)]
                if decode:
                    paths.append(("old", kernels.default_config(m, n, k, w.group_size, dev)))
                for path, cfg in paths:
                    try:
                        got = kernels.w4a16_matmul(x, w, cfg)
                        err = rel_err(got, ref)
                        fn = (lambda v, cfg=cfg: kernels.w4a16_matmul(x, v, cfg))
                        cold, outs = cold_us(fn, rotation) if decode else (float("nan"), [])
                        # the graph's outputs after replays: the split-K counters must have been left at zero
                        err = max([err] + [rel_err(o, ref) for o in outs[:1] + outs[-1:]])
                        eager, graph = bench_us(lambda: fn(w))
                    except Exception as error:  # noqa: BLE001 - one broken shape must not hide the others
                        failures += 1
                        print(f"{name:22} {kind:4} {m:4d} {n:6d} {k:5d} {path:5} FAILED: {type(error).__name__}: "
                              f"{str(error)[:200]}")
                        continue
                    failures += not err < BOUND
                    shown = cfg or (kernels.gemv_config(m, n, k, w.group_size, dev) if decode
                                    else kernels.default_config(m, n, k, w.group_size, dev))
                    if not decode:  # GEMM: report against the L2-flushed eager time and in TFLOP/s
                        cold = eager
                    row(name, kind, m, n, k, path, err, cold, graph, eager, nbytes(w, m, k, n), shown)
                    if not decode:
                        print(f"{'':22} {2 * m * n * k / (eager * 1e-6) / 1e12:8.1f} TFLOP/s")
                if decode and kind == "sym":
                    xs = x
                    cold, _ = cold_us(lambda d: F.linear(xs, d), dense_rotation)
                    eager, graph = bench_us(lambda: F.linear(xs, dense))
                    row(name, kind, m, n, k, "bf16", float("nan"), cold, graph, eager,
                        dense.numel() * 2 + 2 * m * (k + n), None)
                if m in sweep_m and kind == "sym":
                    gemv_t, _ = cold_us(lambda v: kernels.w4a16_matmul(x, v), rotation, replays=3)
                    best, bad = sweep(kernels, x, w, rotation, ref)
                    failures += bad
                    if best:
                        best_rows.append((name, m, n, k, gemv_t, best, nbytes(w, m, k, n)))
            del rotation, dense_rotation
            torch.cuda.empty_cache()
    if best_rows:
        print("\nGEMV sweep (cold CUDA graph): heuristic vs best config")
        for name, m, n, k, t, (bt, cfg), nb in best_rows:
            print(f"{name:22} M={m} heuristic {t:6.2f} us  best {bt:6.2f} us ({nb / (bt * 1e-6) / 1e9:5.0f} GB/s, "
                  f"{100 * nb / (bt * 1e-6) / COPY_CEILING:4.1f}%)  {fmt_cfg(cfg)}")
        print("\nTUNED entries (flashnext/ops/w4a16_triton.py), (N, K, M bucket): GemvConfig(...)")
        for _, m, n, k, _, (_, c), _ in best_rows:
            print(f"    ({n}, {k}, {kernels.m_bucket(m)}): GemvConfig({c.block_n}, {c.block_k}, {c.split_k}, "
                  f"{c.use_dot}, {c.num_warps}, {c.num_stages}),")
    print(f"\n{'ALL CORRECT' if not failures else f'{failures} FAILURE(S)'} (err = max|triton - reference| / "
          f"max|reference|, bound {BOUND} for bf16 output)  {time.perf_counter() - began:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
