"""Paged decode attention on the GPU: correctness against the torch reference and timings at model shapes.

    python scripts/gpu_decode_attention.py           # the table (~30 s on an H200)
    python scripts/gpu_decode_attention.py --sweep   # also a launch-config sweep at 64K (~1 min more)
    python scripts/gpu_decode_attention.py --prefill-rows   # only: configs for a prefill's token lists (~1 min)

bf16, D = 256, pages of 64 tokens scattered over the pool, H = 24 (Flash-Next) and 16 (Qwen3-Next) query
heads over 2 kv heads, B in (1, 8); dense contexts of 1K, 8K and 64K, "1K@64K" (1K tokens in a table sized
for 64K: a decode graph captured for the longest context), and the QSA sparse mode (T = 2051 entries,
2048 valid, at 64K). Each row checks split_k_decode_attention against decode_attention_reference, then times
it with triton.testing.do_bench (eager) and do_bench_cudagraph (the decode engine's situation). GB/s counts
the K/V bytes the query must read once (visible tokens × KVH × D × 2 tensors × 2 bytes) against the
4.27 TB/s device-to-device copy ceiling (PERF.md); graph rows under ~50 MB of K/V may be served from L2
(do_bench_cudagraph does not flush it; eager do_bench does, but pays launches). A graph replay with
shortened seq_lens checks that the captured launch follows lengths changed on the device. Exits non-zero
on any mismatch or capture failure.
"""
from __future__ import annotations

import argparse
import math
import sys
from functools import partial

import torch
import triton

COPY_CEILING = 4.27e12
KV_HEADS, HEAD_DIM, PAGE, PICKS, VALID = 2, 256, 64, 2051, 2048
TOLERANCE = 1e-2  # max|triton - reference| / max|reference|, bf16 output


def make_case(batch, heads, context, gen, *, table=None, sparse=False):
    """Each sequence owns a random set of pages; lengths are context - 37·b (ragged, mid-page)."""
    dev = torch.device("cuda")
    width = (table or context) // PAGE
    pages = batch * width
    lens = torch.tensor([max(1, context - 37 * b) for b in range(batch)], device=dev)
    case = {
        "q": torch.randn(batch, heads, HEAD_DIM, device=dev, generator=gen).bfloat16(),
        "k_cache": torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device=dev, generator=gen).bfloat16(),
        "v_cache": torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device=dev, generator=gen).bfloat16(),
        "block_table": torch.randperm(pages, device=dev, generator=gen).view(batch, width).int(),
        "seq_lens": lens.int(), "scale": HEAD_DIM ** -0.5}
    tokens = int(lens.sum())
    if sparse:
        index = torch.stack([torch.randperm(int(n), device=dev, generator=gen)[:PICKS] for n in lens])
        valid = torch.zeros(batch, PICKS, dtype=torch.bool, device=dev)
        valid[:, :VALID] = True
        case.update(token_index=index, token_valid=valid)
        tokens = batch * VALID
    return case, 2 * tokens * KV_HEADS * HEAD_DIM * 2


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def bench(fn):
    import triton.testing as tt

    eager = tt.do_bench(fn, warmup=10, rep=40)
    try:
        graph = tt.do_bench_cudagraph(fn, rep=40)
    except Exception as error:  # noqa: BLE001 - reported as a failure, the other rows still run
        print(f"  CUDA graph capture failed: {type(error).__name__}: {error}")
        graph = float("nan")
    return eager, graph


def graph_follows_lengths(kernels, reference, gen) -> bool:
    """Capture at 8K, shorten seq_lens in place (1 and mid-page values), replay, compare."""
    case, _ = make_case(8, 24, 8192, gen)
    kernels.split_k_decode_attention(**case)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.split_k_decode_attention(**case)
    case["seq_lens"].copy_(torch.tensor([1, 63, 65, 1000, 4097, 8000, 8192, 300], device="cuda"))
    graph.replay()
    err = rel_err(out, reference(**case))
    print(f"graph replay with seq_lens changed after capture: err {err:.1e} {'ok' if err < TOLERANCE else 'MISMATCH'}")
    return err < TOLERANCE


def sweep(kernels, gen):
    import triton.testing as tt

    print("\nsweep at 64K (CUDA graph us): default vs best (block_n, min_split, splits, warps, stages)")
    for batch in (1, 8):
        for sparse in (False, True):
            case, nbytes = make_case(batch, 24, 65536, gen, sparse=sparse)
            span = PICKS if sparse else 65536
            default = kernels.default_config(batch, KV_HEADS, HEAD_DIM, span, torch.device("cuda"))
            results = []
            for block_n in (16, 32, 64):
                for splits in sorted({max(1, default.num_splits // 2), default.num_splits, 2 * default.num_splits}):
                    for warps, stages in ((4, 2), (4, 3), (8, 2)):
                        cfg = kernels.LaunchConfig(splits, block_n, 128, warps, stages)
                        try:
                            t = tt.do_bench_cudagraph(partial(kernels.split_k_decode_attention, **case, config=cfg),
                                                      rep=20)
                        except Exception:  # noqa: BLE001, S112 - configs that do not compile or fit are skipped
                            continue
                        results.append((t, cfg))
            base = tt.do_bench_cudagraph(partial(kernels.split_k_decode_attention, **case), rep=20)
            t, cfg = min(results, key=lambda r: r[0])
            print(f"B={batch} {'sparse' if sparse else 'dense '} default {base * 1e3:7.1f} us "
                  f"({nbytes / (base * 1e-3) / 1e9:5.0f} GB/s)  best {t * 1e3:7.1f} us "
                  f"({nbytes / (t * 1e-3) / 1e9:5.0f} GB/s)  {cfg}")


def prefill_lists_case(rows, context, gen):
    """A prefill chunk's token-list attention (GatedAttention._attend_lists): `rows` queries of one sequence after
    `context` cached tokens share its table; each attends 512 blocks of 4 tokens drawn at random (QSA with random
    weights) plus its 3 tail tokens, in ascending order, as ops/qsa_token_lists writes them."""
    dev = torch.device("cuda")
    total = context + rows
    width = triton.cdiv(total, PAGE)
    queries = torch.arange(context, total, device=dev)
    blocks = torch.rand(rows, total // 4, device=dev, generator=gen).masked_fill(
        torch.arange(total // 4, device=dev)[None, :] >= (queries[:, None] // 4), 2.0)
    chosen = blocks.topk(512, dim=1, largest=False).indices.sort(dim=1).values
    index = torch.cat([(4 * chosen[:, :, None] + torch.arange(4, device=dev)).flatten(1),
                       queries[:, None] + torch.arange(-2, 1, device=dev)[None, :]], dim=1)
    case = {"q": torch.randn(rows, 24, HEAD_DIM, device=dev, generator=gen).bfloat16(),
            "k_cache": torch.randn(width, PAGE, KV_HEADS, HEAD_DIM, device=dev, generator=gen).bfloat16(),
            "v_cache": torch.randn(width, PAGE, KV_HEADS, HEAD_DIM, device=dev, generator=gen).bfloat16(),
            "block_table": torch.randperm(width, device=dev, generator=gen)[None, :].expand(rows, -1),
            "seq_lens": (queries + 1).int(), "scale": HEAD_DIM ** -0.5,
            "token_index": index.int().contiguous(), "token_valid": None}
    return case, rows * index.shape[1] * KV_HEADS * HEAD_DIM * 2 * 2


def prefill_rows_sweep(kernels, reference, gen) -> int:
    """Launch configs for many rows of one sequence's token lists (one split each by default_config): ms a call
    (do_bench, L2 flushed), the default first; the best checked against the reference on its first 64 rows."""
    import triton.testing as tt

    failures = 0
    print("\nprefill token lists (ms a call; GB/s of the K/V bytes the lists name, each row's read once)")
    for rows, context in ((1024, 32768), (4096, 32768)):
        case, nbytes = prefill_lists_case(rows, context, gen)
        default = kernels.default_config(rows, KV_HEADS, HEAD_DIM, case["token_index"].shape[1], torch.device("cuda"))
        results = []
        for block_n in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4):
                    cfg = kernels.LaunchConfig(default.num_splits, block_n, max(128, block_n), warps, stages)
                    try:
                        t = tt.do_bench(partial(kernels.split_k_decode_attention, **case, config=cfg), warmup=5,
                                        rep=30)
                    except Exception:  # noqa: BLE001, S112 - configs that do not compile or fit are skipped
                        continue
                    results.append((t, cfg))
        base = tt.do_bench(partial(kernels.split_k_decode_attention, **case), warmup=5, rep=30)
        print(f"{rows} rows after {context}: default {base:.3f} ms ({nbytes / (base * 1e-3) / 1e9:.0f} GB/s) {default}")
        for t, cfg in sorted(results, key=lambda r: r[0])[:6]:
            print(f"  {t:.3f} ms ({nbytes / (t * 1e-3) / 1e9:.0f} GB/s)  block_n {cfg.block_n} warps {cfg.num_warps} "
                  f"stages {cfg.num_stages}")
        best = min(results, key=lambda r: r[0])[1]
        head = {k: (v[:64] if isinstance(v, torch.Tensor) and v.shape[0] == rows else v) for k, v in case.items()}
        err = rel_err(kernels.split_k_decode_attention(**head, config=best), reference(**head))
        failures += err >= TOLERANCE
        print(f"  best config against the reference (64 rows): err {err:.1e} {'ok' if err < TOLERANCE else 'MISMATCH'}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--prefill-rows", action="store_true", help="only the prefill token-list config sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from flashnext.ops import decode_attention_triton as kernels
    from flashnext.ops.decode_attention import decode_attention_reference as reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.prefill_rows:
        failures = prefill_rows_sweep(kernels, reference, gen)
        print(f"\n{'ALL CORRECT' if not failures else f'{failures} FAILURE(S)'}")
        return 1 if failures else 0
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {kernels.triton.__version__}")
    header = (f"{'H':>3} {'B':>2} {'mode':>8} {'splits':>6} {'err':>8} {'eager us':>9} {'graph us':>9} "
              f"{'KV MB':>7} {'GB/s':>6} {'%ceil':>6}")
    print(header)
    print("-" * len(header))
    rows = [("1K", 1024, None, False), ("8K", 8192, None, False), ("64K", 65536, None, False),
            ("1K@64K", 1024, 65536, False), ("sparse", 65536, None, True)]
    failures = 0
    for heads in (24, 16):
        for batch in (1, 8):
            for name, context, table, sparse in rows:
                case, nbytes = make_case(batch, heads, context, gen, table=table, sparse=sparse)
                span = PICKS if sparse else case["block_table"].shape[1] * PAGE
                cfg = kernels.default_config(batch, KV_HEADS, HEAD_DIM, span, torch.device("cuda"))
                try:
                    err = rel_err(kernels.split_k_decode_attention(**case), reference(**case))
                    eager, graph = bench(partial(kernels.split_k_decode_attention, **case))
                except Exception as error:  # noqa: BLE001 - one broken shape must not hide the others
                    failures += 1
                    print(f"{heads:3d} {batch:2d} {name:>8}  FAILED: {type(error).__name__}: {error}")
                    continue
                ok = err < TOLERANCE and not math.isnan(graph)
                failures += not ok
                t = eager if math.isnan(graph) else graph
                gbs = nbytes / (t * 1e-3) / 1e9
                print(f"{heads:3d} {batch:2d} {name:>8} {cfg.num_splits:6d} {err:8.1e}{' ' if ok else '!'}"
                      f"{eager * 1e3:8.1f} {graph * 1e3:9.1f} {nbytes / 1e6:7.1f} {gbs:6.0f} "
                      f"{100 * gbs * 1e9 / COPY_CEILING:5.1f}%")
    failures += not graph_follows_lengths(kernels, reference, gen)
    if args.sweep:
        sweep(kernels, gen)
    print(f"\n{'ALL CORRECT' if not failures else f'{failures} FAILURE(S)'} (err = max|triton - reference| / "
          f"max|reference|, bound {TOLERANCE} for bf16 output)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
