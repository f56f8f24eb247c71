"""On the GPU machine: the INT4 MoE kernels at the real shapes — correct against the torch reference, and how
fast: decode M = 1, 2, 4, 8 (the decode GEMV kernels of moe_int4_decode_triton against the grouped kernels of
moe_int4_triton, which decode ran before), M = 16–128 (the grouped kernels' small-M configs: decode batches of
16, the chained steps of a short prompt chunk) and prefill M = 4096 (grouped, and FLASHNEXT_MOE_PREFILL=dequant's
dequantised experts through torch's grouped GEMM), with small config sweeps.

Flash-Next (H 2560, I 640) and Qwen3-Next (H 2048, I 512): E 512, top-10, g 128, symmetric (plus asymmetric
and act-order correctness checks). Routing comes from a random zero-mean router on random activations, so
tokens spread over the experts (PERF.md: positive-only weights collapse routing); the coverage is printed.
Bandwidth = bytes of expert weights read (qweight + scales of every distinct routed expert) / time, against
the 4.27 TB/s copy ceiling (the decode kernels re-read an expert chosen by several tokens, mostly from L2:
the same useful bytes are counted for both). Times are triton.testing.do_bench medians (L2 flushed before
each call) and, for decode, do_bench_cudagraph over 8 layers' distinct weights (per-layer µs), as the engine
runs it; rows are sorted by the smaller of the two. The decode checks also ask for the same bits run to
run, alone and in a batch, and replayed in a CUDA graph (the kernels add their partials with arrival
counters). Exits non-zero on a mismatch.
Run: python3 scripts/gpu_moe.py [--check-only] [--quick] [--prefill] [flash-next|qwen3-next]
     (--check-only: the checks and ops/expert_order's, nothing timed; --quick: default configs only, no sweeps;
     --prefill: only the prefill sizes PREFILL_PARTS_M, FLASHNEXT_MOE_PREFILL=dequant taken apart into its steps
     beside the grouped kernels and the transposed-tile kernels' SWAPPED_SWEEP; --swapped-sizes: the transposed-tile
     kernels' SIZES_SWEEP against the grouped kernels' tiles and the dequant path from 128 to 16,384 tokens, one line
     a size; --magic: the transposed-tile kernels with ops/int4_magic.py's dequantisation against the plain one,
     bits compared and times from 8 to 16,384 tokens beside the decode kernels and the dequant path; a model name:
     only its shapes)
"""
import sys

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from flashnext.ops.moe_int4 import DECODE_MAX_M, moe_int4_reference
from flashnext.ops.moe_int4_decode_triton import DEFAULT, DecodeConfig, moe_int4_decode
from flashnext.ops.gated_elementwise import silu_mul
from flashnext.ops.int4_dequant_triton import dequantize_triton
from flashnext.ops.moe_combine import combine_choices
from flashnext.ops.moe_int4_dequant import moe_int4_dequant
from flashnext.ops.moe_int4_swapped_triton import SwappedConfig, moe_int4_swapped, runs_swapped
from flashnext.ops.moe_int4_triton import PREFILL, SMALL, MoeConfig, moe_int4_triton
from flashnext.weights.int4_layout import Int4Weight
from gpu_common import environment, rel

CEILING = 4.27e12
SHAPES = {"flash-next": (2560, 640), "qwen3-next": (2048, 512)}
E, TOP_K, G = 512, 10, 128
DECODE_M, PREFILL_M = (1, 2, 4, 8), 4096
# Mid-sized batches: a decode step of 16 sequences, and the chained steps of a short prompt chunk
# (DecodeGraphs.extend): the grouped kernels with small-M configs, timed in a graph over LAYERS layers.
MID_M = (16, 32, 64, 128)
LAYERS = 8
# prefill chunks: a 4K chunk, a 10K prompt in one chunk, the 16,384-token step of GPUs of 72 GiB or more
PREFILL_PARTS_M = (4096, 10000, 16384)
# (block_n, down_block_n, block_k, split_k, split_down, warps, stages); split 0 = by the shapes (~4 programs
# per SM at M = 1)
DECODE_SWEEP = [DEFAULT] + [DecodeConfig(*c) for c in [
    (32, 128, 128, 0, 0, 4, 3), (32, 256, 128, 0, 0, 4, 3), (32, 256, 128, 0, 0, 8, 3), (64, 128, 128, 0, 0, 4, 3),
    (64, 256, 128, 0, 0, 8, 3), (128, 128, 128, 0, 0, 4, 4), (128, 256, 128, 0, 0, 8, 3),
    (64, 128, 128, 0, 0, 8, 2), (32, 64, 128, 0, 0, 4, 3), (64, 64, 128, 0, 0, 4, 3), (64, 0, 128, 10, 5, 4, 3)]]
MID_SWEEP = [SMALL, PREFILL] + [MoeConfig(bm, bn, bk, w, st, tile) for bm, bn, bk, w, st, tile in [
    (16, 64, 128, 4, 3, False), (16, 64, 64, 4, 4, False), (16, 128, 128, 8, 3, False), (16, 32, 128, 4, 3, False),
    (16, 128, 64, 8, 4, False), (16, 256, 64, 8, 4, False), (16, 128, 32, 4, 4, False), (16, 128, 64, 4, 3, False),
    (16, 128, 64, 4, 5, False)]]
# the transposed-tile kernels (block_m rows: the MMA's N side; block_n: its M side, 64 a warp group)
SWAPPED_SWEEP = [SwappedConfig(bm, bn, w, st) for bm, bn, w, st in [
    (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (32, 128, 4, 4), (64, 64, 4, 4), (128, 64, 4, 3),
    (64, 256, 8, 3), (128, 256, 8, 3), (32, 64, 4, 4), (128, 128, 4, 3)]]
# every prefill size the engine meets: chained steps' chunks, a decode step's prefill budget, a turn's new tokens, a
# whole 10K prompt, the 16,384-token step
SIZES_M = (128, 256, 512, 1024, 2048, 4096, 6144, 8192, 10000, 16384)
SIZES_SWEEP = [SwappedConfig(bm, bn, w, st) for bm, bn, w, st in [
    (16, 64, 4, 3), (16, 128, 4, 3), (32, 64, 4, 4), (32, 128, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 3),
    (128, 64, 8, 3), (128, 128, 8, 3)]]
PREFILL_SWEEP = [PREFILL] + [MoeConfig(bm, bn, bk, w, s) for bm, bn, bk, w, s in
                             [(64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 128, 128, 8, 3), (128, 64, 64, 4, 4),
                              (32, 128, 64, 4, 4), (128, 128, 128, 8, 2)]]


def random_experts(n, k, asym=False, act_order=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31 - 1, (E, k // 8, n), generator=g, device="cuda", dtype=torch.int32)
    # Zero-mean, signed scales sized so that activations stay O(1) through gate/up and down.
    scales = (torch.randn(E, k // G, n, generator=g, device="cuda") / (4.6 * k ** 0.5)).to(torch.bfloat16)
    zeros = torch.randint(0, 17, (E, k // G, n), generator=g, device="cuda").to(torch.uint8) if asym else None
    perm = torch.rand(E, k, generator=g, device="cuda").argsort(-1).to(torch.int32) if act_order else None
    return Int4Weight(qweight, scales, zeros, perm, G)


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
    for kind in ("sym", "asym", "act-order"):
        wgu = random_experts(2 * i, h, kind == "asym", kind == "act-order", 0)
        wd = random_experts(h, i, kind == "asym", kind == "act-order", 1)
        for m in (1, 8, DECODE_MAX_M, 300):   # the decode kernels take up to DECODE_MAX_M tokens
            x, ids, w = routing(m, h, seed=m)
            ref = moe_int4_reference(x.float(), ids, w, wgu, wd)
            kernels = [("grouped", moe_int4_triton)] + (
                [("decode", moe_int4_decode)] if m <= DECODE_MAX_M else [("dequant", moe_int4_dequant)] +
                ([("swapped", moe_int4_swapped)] if runs_swapped(wgu, wd, x.device) else []))
            for label, fn in kernels:
                e16 = rel(fn(x, ids, w, wgu, wd), ref)
                e32 = rel(fn(x.float(), ids, w, wgu, wd), ref)
                # bf16: x (and, grouped only, h) rounded to bf16 as in the bf16 model; fp32: summation order only.
                good = e16 < 2e-2 and e32 < 1e-4
                ok &= good
                print(f"  check {name:10} {kind:9} M={m:<4} {label:7} bf16 {e16:.2e}  fp32 {e32:.2e}  "
                      f"{'ok' if good else 'MISMATCH'}")
        ok &= check_decode_bits(name, kind, h, wgu, wd)
    return ok


def check_decode_bits(name, kind, h, wgu, wd) -> bool:
    """Same bits twice, a token alone as in a batch of DECODE_MAX_M, and replayed in a CUDA graph as run eagerly."""
    x, ids, w = routing(DECODE_MAX_M, h, seed=8)
    first = moe_int4_decode(x, ids, w, wgu, wd)
    again = torch.equal(first, moe_int4_decode(x, ids, w, wgu, wd))
    alone = torch.equal(first[5:6], moe_int4_decode(x[5:6], ids[5:6], w[5:6], wgu, wd))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_int4_decode(x, ids, w, wgu, wd)
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(torch.equal(captured, first))
    good = again and alone and all(replays)
    print(f"  check {name:10} {kind:9} decode bits: repeat {again}, alone {alone}, graph {replays}  "
          f"{'ok' if good else 'MISMATCH'}")
    return good


def _timed(fn, step, graph):
    t = do_bench(fn, warmup=10, rep=40) * 1e-3
    tg = do_bench_cudagraph(step, rep=40) * 1e-3 / LAYERS if graph else float("nan")
    return (min(t, tg) if graph else t), t, tg


def bench(name, h, i, quick):
    # LAYERS distinct weight sets: the CUDA-graph replay runs them in turn, as a decode step runs its layers,
    # so 10 experts' 25 MB cannot stay in the 50 MB L2 from one replay to the next.
    layers = [(random_experts(2 * i, h, seed=2 * n), random_experts(h, i, seed=2 * n + 1)) for n in range(LAYERS)]
    wgu, wd = layers[0]
    print(f"\n{name}: H={h} I={i} E={E} top-{TOP_K} g{G} — per layer, routed experts only")
    print(f"  {'M':>5} {'experts':>7} {'MB read':>8} {'kernel / config':>34} {'µs (bench)':>10} {'µs (graph)':>10} "
          f"{'GB/s':>7} {'% ceil':>6}")
    best_decode = {}
    for m in DECODE_M + MID_M + (PREFILL_M,):
        x, ids, w = routing(m, h, seed=m)
        experts = ids.unique().numel()
        nbytes = weight_bytes(wgu, experts) + weight_bytes(wd, experts)
        decode = m in DECODE_M or m in MID_M   # timed in a graph over the layers too
        if m in DECODE_M:
            runs = [("grouped", moe_int4_triton, SMALL)]
            runs += [("decode", moe_int4_decode, c) for c in (DECODE_SWEEP[:1] if quick else DECODE_SWEEP)]
        elif m in MID_M:
            runs = [("grouped", moe_int4_triton, c) for c in (MID_SWEEP[:2] if quick else MID_SWEEP)]
            runs.append(("decode", moe_int4_decode, DEFAULT))   # re-reads an expert per token that chose it
        else:
            runs = [("grouped", moe_int4_triton, c) for c in (PREFILL_SWEEP[:1] if quick else PREFILL_SWEEP)]
            # FLASHNEXT_MOE_PREFILL=dequant: the layer's experts dequantised, then torch's grouped GEMM
            runs.append(("dequant", lambda x, ids, w, a, b, cfg: moe_int4_dequant(x, ids, w, a, b), None))
        results = []
        for label, op, cfg in runs:
            fn = lambda: op(x, ids, w, wgu, wd, cfg)  # noqa: E731
            step = lambda: [op(x, ids, w, a, b, cfg) for a, b in layers]  # noqa: E731
            try:
                results.append((*_timed(fn, step, decode), label, cfg))
            except Exception as exc:  # a config that does not compile (shared memory, registers): skip it
                print(f"  {m:5d} {'':7} {'':8} {label + ' ' + _cfg(cfg):>34} failed: {type(exc).__name__}: "
                      f"{str(exc)[:80]}")
        for rank, (tt, t, tg, label, cfg) in enumerate(sorted(results, key=lambda r: r[0])):
            print(f"  {m:5d} {experts:7d} {nbytes / 1e6:8.1f} {label + ' ' + _cfg(cfg):>34} {t * 1e6:10.1f} "
                  f"{tg * 1e6:10.1f} {nbytes / tt / 1e9:7.0f} {100 * nbytes / tt / CEILING:5.1f}%"
                  f"{'  <- best' if rank == 0 and len(results) > 1 else ''}")
        if m in DECODE_M:
            best_decode[m] = {_cfg(cfg): tt for tt, _, _, label, cfg in results if label == "decode"}
    if best_decode and not quick:
        totals = {c: sum(best_decode[m].get(c, float("inf")) for m in DECODE_M) for c in best_decode[DECODE_M[0]]}
        winner = min(totals, key=totals.get)
        print(f"  decode config with the least time summed over M = {DECODE_M}: {winner} "
              f"({totals[winner] * 1e6:.1f} µs; default {_cfg(DEFAULT)}: {totals[_cfg(DEFAULT)] * 1e6:.1f} µs)")


def _median_ms(fn) -> float:
    """do_bench's median (L2 flushed), or inf for a sweep's config past the shared memory or registers."""
    try:
        return do_bench(fn, warmup=5, rep=30)
    except Exception:
        return float("inf")


def prefill_parts(name, h, i) -> bool:
    """The dequant path's steps one by one (do_bench medians, L2 flushed) beside the grouped kernels and the whole
    path, at prefill chunk sizes; TFLOP/s counts the routed experts' three matmuls (2·M·k·3·H·I)."""
    wgu, wd = random_experts(2 * i, h, seed=0), random_experts(h, i, seed=1)
    print(f"\n{name}: prefill MoE per layer, ms (TFLOP/s of the whole)")
    ok = True
    for m in PREFILL_PARTS_M:
        x, ids, w = routing(m, h, seed=m)
        flop = 2 * m * TOP_K * 3 * h * i
        sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
        ends = torch.searchsorted(sorted_ids, torch.arange(E, device="cuda", dtype=sorted_ids.dtype),
                                  right=True).to(torch.int32)
        rows = x.index_select(0, order // TOP_K)
        gu16, d16 = dequantize_triton(wgu, x.dtype), dequantize_triton(wd, x.dtype)
        gu16_k = gu16.transpose(-1, -2).contiguous().transpose(-1, -2)   # K-contiguous (column-major) weights
        gate_up = torch._grouped_mm(rows, gu16, offs=ends)
        hmid = silu_mul(*gate_up.chunk(2, dim=-1))
        y = torch._grouped_mm(hmid, d16, offs=ends)
        position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device="cuda")).view(m, TOP_K)
        parts = {
            "grouped kernels (PREFILL)": lambda: moe_int4_triton(x, ids, w, wgu, wd, PREFILL),
            **{f"swapped kernels {_cfg(c)}": (lambda c=c: moe_int4_swapped(x, ids, w, wgu, wd, c)) for c in SWAPPED_SWEEP},
            "dequant path, whole": lambda: moe_int4_dequant(x, ids, w, wgu, wd),
            "  sort + ends + gather rows": lambda: (torch.sort(ids.reshape(-1), stable=True),
                                                  torch.searchsorted(sorted_ids, ends.long(), right=True),
                                                  x.index_select(0, order // TOP_K)),
            "  dequantise gate|up": lambda: dequantize_triton(wgu, x.dtype),
            "  dequantise down": lambda: dequantize_triton(wd, x.dtype),
            "  grouped_mm gate|up": lambda: torch._grouped_mm(rows, gu16, offs=ends),
            "  grouped_mm gate|up, K-major weights": lambda: torch._grouped_mm(rows, gu16_k, offs=ends),
            "  silu_mul": lambda: silu_mul(*gate_up.chunk(2, dim=-1)),
            "  grouped_mm down": lambda: torch._grouped_mm(hmid, d16, offs=ends),
            "  combine": lambda: combine_choices(y, position, w, x.dtype),
        }
        err = rel(moe_int4_swapped(x, ids, w, wgu, wd), moe_int4_dequant(x, ids, w, wgu, wd))
        print(f"  M={m:5d} swapped kernels against the dequant path: {err:.2e} {'ok' if err < 2e-2 else 'MISMATCH'}")
        ok &= err < 2e-2
        for label, fn in parts.items():
            t = _median_ms(fn) * 1e-3
            print(f"  M={m:5d} {label:40} " + (f"{t * 1e3:8.3f} ms {flop / t / 1e12:7.0f}" if t < float("inf")
                                                else "failed to run (shared memory or registers)"))
        del gu16, d16, gu16_k, gate_up, hmid, y
    return ok


def swapped_sizes(name, h, i):
    """One line a prefill size: ms per layer of the grouped kernels (their default tiles for the size), the dequant
    path and each SIZES_SWEEP config of the transposed-tile kernels (do_bench medians, L2 flushed), and the fastest;
    first each config against the dequant path (bf16), sym and asym. → whether every config matched."""
    ok = True
    for asym in (False, True):
        wgu, wd = random_experts(2 * i, h, asym, seed=0), random_experts(h, i, asym, seed=1)
        x, ids, w = routing(777, h, seed=7)
        want = moe_int4_dequant(x, ids, w, wgu, wd)
        errs = {}
        for c in SIZES_SWEEP:
            try:
                errs[_cfg(c)] = rel(moe_int4_swapped(x, ids, w, wgu, wd, c), want)
            except Exception as exc:   # a config past the shared memory or registers: timed as failed below
                print(f"  check {name} {_cfg(c)} failed to run: {type(exc).__name__} {str(exc)[:80]}")
        bad = [label for label, e in errs.items() if not e < 2e-2]
        ok &= not bad
        print(f"  check {name} {'asym' if asym else 'sym '} M=777 against the dequant path: worst "
              f"{max(errs.values()):.2e} {'ok' if not bad else 'MISMATCH ' + str(bad)}")
    wgu, wd = random_experts(2 * i, h, seed=0), random_experts(h, i, seed=1)
    labels = ["grouped", "dequant"] + [_cfg(c) for c in SIZES_SWEEP]
    print(f"\n{name}: prefill MoE per layer by size, ms")
    print("      M " + " ".join(f"{label:>21}" for label in labels) + "  fastest")
    for m in SIZES_M:
        x, ids, w = routing(m, h, seed=m)
        fns = [lambda: moe_int4_triton(x, ids, w, wgu, wd), lambda: moe_int4_dequant(x, ids, w, wgu, wd)] + [
            (lambda c=c: moe_int4_swapped(x, ids, w, wgu, wd, c)) for c in SIZES_SWEEP]
        times = [_median_ms(fn) for fn in fns]
        best = min(range(len(times)), key=times.__getitem__)
        print(f"  {m:5d} " + " ".join(f"{t:21.3f}" for t in times) + f"  {labels[best]}")
    return ok


MAGIC_SIZES_M = (8, 16, 32, 64, 128, 256, 1024, 2048, 4096, 8192, 10000, 16384)


def magic_sizes(name, h, i):
    """One line a size: ms per layer of the transposed-tile kernels (config_for's tiles) with the plain
    dequantisation (FLASHNEXT_INT4_MAGIC=0) and with the trick, whether their outputs are the same bits (sym and
    asym weights), and the other paths the engine could take (the decode kernels up to 64 tokens, the dequant
    path from 4,096). → whether all were equal."""
    ok = True
    print(f"\n{name}: transposed tiles, plain vs magic dequantisation, ms per layer (do_bench medians, L2 flushed)")
    print(f"  {'M':>6} {'plain':>8} {'magic':>8} {'gain':>6} {'decode':>8} {'dequant':>8}  bits")
    for asym in (False, True):
        wgu, wd = random_experts(2 * i, h, asym, seed=0), random_experts(h, i, asym, seed=1)
        for m in MAGIC_SIZES_M if not asym else (16, 4096):
            x, ids, w = routing(m, h, seed=m)
            runs = {}
            for flag in ("0", "1"):
                with environment({"FLASHNEXT_INT4_MAGIC": flag}):
                    out = moe_int4_swapped(x, ids, w, wgu, wd)
                    runs[flag] = (out, _median_ms(lambda: moe_int4_swapped(x, ids, w, wgu, wd)))
            equal = torch.equal(runs["0"][0], runs["1"][0])
            ok &= equal
            plain, magic = runs["0"][1], runs["1"][1]
            decode = _median_ms(lambda: moe_int4_decode(x, ids, w, wgu, wd)) if m <= 64 else float("nan")
            dequant = _median_ms(lambda: moe_int4_dequant(x, ids, w, wgu, wd)) if m >= 4096 else float("nan")
            print(f"  {m:6d} {plain:8.3f} {magic:8.3f} {plain / magic:6.2f} {decode:8.3f} {dequant:8.3f}  "
                  f"{'equal' if equal else 'DIFFER'}{' (asym)' if asym else ''}")
    return ok


def _cfg(c) -> str:
    if c is None:
        return "(cuBLAS grouped)"
    if isinstance(c, SwappedConfig):
        return f"m{c.block_m} n{c.block_n} w{c.num_warps} s{c.num_stages}"
    if isinstance(c, DecodeConfig):
        return (f"n{c.block_n}/{c.down_block_n or c.block_n} k{c.block_k} s{c.split_k}/{c.split_down} w{c.num_warps} "
                f"st{c.num_stages}")
    return f"m{c.block_m} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}{' tile' if c.scale_in_tile else ''}"


def expert_order_check() -> bool:
    """ops/expert_order's kernels against its reference at prefill sizes: the same sorted experts, ends and block
    table, an order the sorted experts follow and its inverse as position."""
    from flashnext.ops.expert_order import expert_order_reference
    from flashnext.ops.expert_order_triton import expert_order_triton

    ok = True
    for m, block_m in ((300, 16), (4096, 128), (16384, 128)):
        _, ids, _ = routing(m, 256, seed=m)
        want, got = expert_order_reference(ids, E, block_m), expert_order_triton(ids, E, block_m)
        same = all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("sorted_ids", "ends", "block_start"))
        flat = ids.reshape(-1).to(torch.int32)
        same &= torch.equal(flat[got.order.long()], got.sorted_ids) and torch.equal(
            got.position[got.order.long()], torch.arange(flat.numel(), device="cuda", dtype=torch.int32))
        ok &= same
        print(f"  check expert order M={m:5d} block {block_m}: {'ok' if same else 'MISMATCH'}")
    return ok


def main() -> int:
    quick = "--quick" in sys.argv
    shapes = {name: shape for name, shape in SHAPES.items() if name in sys.argv[1:]} or SHAPES
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    ok = all([check(name, h, i) for name, (h, i) in shapes.items()]) and expert_order_check()
    for name, (h, i) in shapes.items() if "--check-only" not in sys.argv else ():
        if "--magic" in sys.argv:
            ok &= magic_sizes(name, h, i)
        elif "--swapped-sizes" in sys.argv:
            ok &= swapped_sizes(name, h, i)
        elif "--prefill" in sys.argv:
            ok &= prefill_parts(name, h, i)
        else:
            bench(name, h, i, quick)
    print("\nall checks passed" if ok else "\nMISMATCH: see the check lines above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
