"""Hyper-connection mix/inject kernels on the GPU: correctness against the torch reference and decode timings
at Flash-Next's shapes (hc 4, hidden 2560, lowrank 320, bf16): the one-row kernels at 1–16 rows, the tensor-core
kernels (ops/hyper_connection_rows_triton.py) and the cuBLAS path from 2.

    python scripts/gpu_hyper_connection.py            # check + one table (~20 s on an H200); from 2 rows also the
                                                      # cuBLAS path
    python scripts/gpu_hyper_connection.py --sweep    # also search launch configs per N (a few minutes)
    python scripts/gpu_hyper_connection.py --sweep-rows   # the same for the tensor-core mix (~10 s per N)

For each N it checks the Triton mix (block input and injection weights) against hc_mix_reference in bf16, that
two launches give identical bits, and that a captured CUDA graph replays to the same bits; then times the
reference (torch eager and in a CUDA graph) and the Triton path with triton.testing.do_bench / do_bench_cudagraph. GB/s counts the weight bytes a mix must read
(down + up + inject + norm weight, 13.2 MB) against the 4.27 TB/s copy ceiling; inject counts h read and
written plus block output. The graph times repeat one mix, whose 13 MB stay in the 50 MB L2: they are lower
bounds of its cost inside a decode step (scripts/gpu_decode.py measures that). Exits non-zero on any mismatch.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from gpu_common import pdl_off

COPY_CEILING = 4.27e12
HC, HIDDEN, LOWRANK, EPS = 4, 2560, 320, 1e-6
ROWS = [1, 2, 4, 8, 16]
TOL = 2e-2  # max|triton - reference| / max|reference|: a 1-ulp bf16 flip of the largest output is up to 0.8%


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def make_weights(dev):
    gen = torch.Generator(device=dev).manual_seed(0)
    width = HC * HIDDEN

    def uniform(*shape, fan_in):  # nn.Linear's default init
        return ((torch.rand(*shape, generator=gen, device=dev) * 2 - 1) / fan_in ** 0.5).bfloat16()

    norm_weight = (torch.randn(width, generator=gen, device=dev) * 0.2).bfloat16()
    return (norm_weight, uniform(LOWRANK, width, fan_in=width), uniform(width, LOWRANK, fan_in=LOWRANK),
            uniform(HC, width, fan_in=width))


def bench(fn):
    import triton.testing as tt

    eager = tt.do_bench(fn, warmup=10, rep=50, return_mode="median")
    graph = tt.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return eager * 1e3, graph * 1e3  # µs


def check(h, weights, mix, reference):
    """Errors of `mix` (block input, injection weights) vs the bf16 reference and vs fp32 math, and bit-stability."""
    ref = reference(h, *weights, HC, HIDDEN, EPS)
    exact = reference(h.float(), *(w.float() for w in weights), HC, HIDDEN, EPS)
    got = mix(h, *weights, HC, HIDDEN, EPS)
    again = mix(h, *weights, HC, HIDDEN, EPS)
    stable = all(torch.equal(a, b) for a, b in zip(got, again))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mix(h, *weights, HC, HIDDEN, EPS)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    stable &= all(torch.equal(a, b) for a, b in zip(got, captured))
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    return errs, [rel_err(r, e) for r, e in zip(ref, exact)], [rel_err(g, e) for g, e in zip(got, exact)], stable


def sweep(h, weights, kernels):
    """Best config in a CUDA graph: the down kernel's row tiles first (default up), then the up kernel's columns."""
    import triton.testing as tt

    def timed(cfg):
        try:
            return tt.do_bench_cudagraph(lambda: kernels.hc_mix_triton(h, *weights, HC, HIDDEN, EPS, config=cfg),
                                         rep=20, return_mode="median") * 1e3
        except Exception:  # noqa: BLE001 - configs that do not compile or fit are skipped
            return float("inf")

    best = (timed(kernels.DEFAULT_CONFIG), kernels.DEFAULT_CONFIG)
    for block_r in (1, 2, 4, 8):
        for warps in (2, 4, 8):
            cfg = dataclasses.replace(best[1], block_r=block_r, warps_down=warps)
            best = min(best, (timed(cfg), cfg), key=lambda b: b[0])
    for block_h in (1, 2, 4, 8):
        for warps in (2, 4, 8):
            cfg = dataclasses.replace(best[1], block_h=block_h, warps_up=warps)
            best = min(best, (timed(cfg), cfg), key=lambda b: b[0])
    return best


def sweep_rows(h, weights, kernels):
    """The tensor-core mix in a CUDA graph after a pending injection, as in a decode step → (the default config's
    µs, (the best µs, its config)): the down kernel's K slices and row tiles, then the up kernel's columns. One mix
    repeated keeps its weights in L2: confirm a config in the step (gpu_decode.py --batch) — session 13's best here
    (14.4 µs, without the injection) took ~600 µs a mix there."""
    import triton.testing as tt

    gen = torch.Generator(device=h.device).manual_seed(1)
    pending = (torch.randn(h.shape[0], HIDDEN, generator=gen, device=h.device).to(h.dtype),
               (torch.rand(h.shape[0], HC, generator=gen, device=h.device) * 2).to(h.dtype))

    def timed(cfg):
        try:
            return tt.do_bench_cudagraph(lambda: kernels.hc_mix_rows_triton(h, pending, *weights, HC, HIDDEN, EPS,
                                                                            config=cfg), rep=20, return_mode="median") * 1e3
        except Exception:  # noqa: BLE001 - configs that do not compile or fit are skipped
            return float("inf")

    default = timed(kernels.DEFAULT_ROWS_CONFIG)
    best = (default, kernels.DEFAULT_ROWS_CONFIG)
    for block_k in (128, 256, 512, 1024):
        for block_r in (16, 32):
            for warps in (4, 8):
                cfg = dataclasses.replace(best[1], block_k=block_k, block_r=block_r, warps_down=warps)
                best = min(best, (timed(cfg), cfg), key=lambda b: b[0])
    for block_h in (4, 8, 16):
        for warps in (2, 4, 8):
            cfg = dataclasses.replace(best[1], block_h=block_h, warps_up=warps)
            best = min(best, (timed(cfg), cfg), key=lambda b: b[0])
    return default, best


def without_pdl(fn):
    """fn timed in a CUDA graph with programmatic dependent launch off."""
    import triton.testing as tt

    with pdl_off():
        return tt.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="search the one-row kernels' launch configs")
    parser.add_argument("--sweep-rows", action="store_true", help="search the tensor-core mix's configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from flashnext.ops import hyper_connection_rows_triton as rows_kernels
    from flashnext.ops import hyper_connection_triton as kernels
    from flashnext.ops.hyper_connection import hc_combine, hc_inject_reference, hc_mix_reference
    from flashnext.ops.rms_norm import rms_norm

    dev = torch.device("cuda")
    weights = make_weights(dev)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {kernels.triton.__version__}  "
          f"hc {HC} hidden {HIDDEN} lowrank {LOWRANK} bf16; mix reads {weight_bytes / 1e6:.1f} MB of weights")
    header = (f"{'op':7} {'N':>2} {'err in/w':>17} {'fp32 err ref/ours':>17} {'ref us':>7} {'ref graph':>9} "
              f"{'ours us':>8} {'ours graph':>10} {'GB/s':>6} {'%ceil':>6} {'speedup':>7}")
    print(header)
    print("-" * len(header))
    failures, sweeps = 0, []
    for n in ROWS:
        gen = torch.Generator(device=dev).manual_seed(n)
        h = (torch.randn(n, HC * HIDDEN, generator=gen, device=dev) * 2).bfloat16()
        try:
            errs, ref_exact, ours_exact, stable = check(h, weights, kernels.hc_mix_triton, hc_mix_reference)
            ok = max(errs) < TOL and stable
            failures += not ok
            ref_t = bench(lambda h=h: hc_mix_reference(h, *weights, HC, HIDDEN, EPS))
            our_t = bench(lambda h=h: kernels.hc_mix_triton(h, *weights, HC, HIDDEN, EPS))
        except Exception as error:  # noqa: BLE001 - one broken size must not hide the others
            failures += 1
            print(f"{'mix':7} {n:2d}  FAILED: {type(error).__name__}: {error}")
            continue
        gbs = weight_bytes / (our_t[1] * 1e-6) / 1e9
        print(f"{'mix':7} {n:2d} {errs[0]:8.1e}/{errs[1]:7.1e}{'' if ok else '!'} "
              f"{max(ref_exact):8.1e}/{max(ours_exact):8.1e} {ref_t[0]:7.1f} {ref_t[1]:9.1f} {our_t[0]:8.1f} "
              f"{our_t[1]:10.1f} {gbs:6.0f} {100 * gbs * 1e9 / COPY_CEILING:5.1f}% {ref_t[1] / our_t[1]:6.2f}x"
              f"{'' if stable else '  NOT BIT-STABLE'}  (graph without PDL: "
              f"{without_pdl(lambda h=h: kernels.hc_mix_triton(h, *weights, HC, HIDDEN, EPS)):.1f} us)")
        if n > 1:   # the tensor-core mix (what hc_mix takes from rows_kernel_min() rows), checked like the others
            def rows_mix(h, *args):
                return rows_kernels.hc_mix_rows_triton(h, None, *args)[:2]

            errs, _, _, stable = check(h, weights, rows_mix, hc_mix_reference)
            ok = max(errs) < TOL and stable
            failures += not ok
            rows_t = bench(lambda h=h: rows_mix(h, *weights, HC, HIDDEN, EPS))
            if args.sweep_rows:
                sweeps.append((n, *sweep_rows(h, weights, rows_kernels)))
            print(f"{'':7} {n:2d} the tensor-core mix: err {errs[0]:.1e}/{errs[1]:.1e}{'' if ok else '!'}"
                  f"{'' if stable else ' NOT BIT-STABLE'}, {rows_t[0]:.1f} us eager, {rows_t[1]:.1f} us in a graph "
                  f"({weight_bytes / (rows_t[1] * 1e-6) / 1e9:.0f} GB/s)")
        if n > 1:   # what FLASHNEXT_HC_DECODE_MAX_ROWS below n gives: the prefill path (cuBLAS GEMMs, norm, combine)
            prefill_t = bench(lambda h=h: hc_mix_reference(h, *weights, HC, HIDDEN, EPS, norm=rms_norm,
                                                           combine=hc_combine))
            print(f"{'':7} {n:2d} the prefill path (cuBLAS): {prefill_t[0]:.1f} us eager, {prefill_t[1]:.1f} us in a graph")
        if args.sweep:
            sweeps.append((n, our_t[1], sweep(h, weights, kernels)))

        block_output = torch.randn(n, HIDDEN, generator=gen, device=dev).bfloat16()
        inject = (torch.rand(n, HC, generator=gen, device=dev) * 2).bfloat16()
        err = rel_err(kernels.hc_inject_triton(h, block_output, inject), hc_inject_reference(h, block_output, inject))
        ok = err < TOL
        failures += not ok
        inputs = (h, block_output, inject)
        ref_t = bench(lambda inputs=inputs: hc_inject_reference(*inputs))
        our_t = bench(lambda inputs=inputs: kernels.hc_inject_triton(*inputs))
        gbs = (2 * h.numel() + block_output.numel()) * 2 / (our_t[1] * 1e-6) / 1e9
        print(f"{'inject':7} {n:2d} {err:17.1e}{'' if ok else '!'} {'':17} {ref_t[0]:7.1f} {ref_t[1]:9.1f} "
              f"{our_t[0]:8.1f} {our_t[1]:10.1f} {gbs:6.0f} {100 * gbs * 1e9 / COPY_CEILING:5.1f}% "
              f"{ref_t[1] / our_t[1]:6.2f}x")
    for n, t, (bt, cfg) in sweeps:
        print(f"sweep N={n}: default {t:.1f} us, best {bt:.1f} us ({weight_bytes / (bt * 1e-6) / 1e9:.0f} GB/s) {cfg}")
    print(f"\n{'ALL CORRECT' if not failures else f'{failures} FAILURE(S)'} (err = max|triton - reference| / "
          f"max|reference| for block input / injection weights, bound {TOL:g}; fp32 err: the bf16 reference and "
          "ours against fp32 math on the same inputs)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
