"""Does prefetching the next op's weights into L2 speed up a chain of decode ops? A feasibility measurement.

    python3 scripts/gpu_l2_prefetch.py [--layers 48]

The batch-1 decode step is a chain of small memory-bound kernels (hyper-connection mixes, INT4 GEMVs) that each
read 1–21 MB of weights L2-cold and run at 25–35% of the DRAM bandwidth (BENCHMARKS.md), while one mix repeated
on L2-warm weights is ~40% faster. This builds a chain shaped like Flash-Next's per layer — mix, qkv|z GEMV, out
GEMV, mix, shared gate|up, shared down (tinygemm, the decode path) — with each layer's own weights, captures it in a
CUDA graph and times replays:
- `plain`: the chain alone;
- `ahead1` / `ahead2`: a second graph branch prefetches op k+1's (k+2's) weights into L2 while op k runs — a
  prefetch kernel of one program issuing bulk L2 prefetches (`cp.async.bulk.prefetch.L2`, Hopper), launched when op
  k−1 has finished (an event edge in the graph);
- `line1`: as ahead1 with one `prefetch.global.L2::evict_last` per 128-byte line over 16 programs instead;
and the sum of each op's time repeated on warm weights (what a perfect prefetch would leave).
A prefetch changes no value, only where the bytes come from: nothing to check but the time.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from gpu_decode import replayed_ms

HC, HIDDEN, LOWRANK, EPS = 4, 2560, 320, 1e-6
CHUNK = 64 * 1024   # bytes a bulk prefetch asks for


@triton.jit
def _bulk_prefetch_kernel(ranges_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    addr = tl.load(ranges_ptr + 2 * offs, mask=ok, other=0)
    size = tl.load(ranges_ptr + 2 * offs + 1, mask=ok, other=0).to(tl.int32)
    done = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(ranges_ptr + 2 * offs, addr + done, mask=ok & (done != 0))


@triton.jit
def _line_prefetch_kernel(ranges_ptr, n, LINES: tl.constexpr):
    # one range (CHUNK bytes) a loop step, a 128-byte line a lane
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        addr = tl.load(ranges_ptr + 2 * i)
        size = tl.load(ranges_ptr + 2 * i + 1)
        lines = tl.arange(0, LINES).to(tl.int64) * 128
        ok = lines < size
        done = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [addr + lines, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(ranges_ptr + 2 * i, addr + tl.sum(done), mask=tl.sum(done) != 0)


def ranges_of(tensors, device):
    """[n, 2] int64 (address, bytes) chunks of CHUNK bytes covering the tensors' storage."""
    rows = []
    for t in tensors:
        start, size = t.data_ptr(), t.numel() * t.element_size()
        size = (size + 15) // 16 * 16
        rows += [(start + o, min(CHUNK, size - o)) for o in range(0, size, CHUNK)]
    return torch.tensor(rows, dtype=torch.int64, device=device)


class Prefetch:
    def __init__(self, tensors, device, mode):
        self.ranges, self.mode = ranges_of(tensors, device), mode

    def __call__(self):
        n = self.ranges.shape[0]
        if self.mode == "bulk":
            _bulk_prefetch_kernel[(triton.cdiv(n, 128),)](self.ranges, n, BLOCK=128, num_warps=4)
        else:
            _line_prefetch_kernel[(16,)](self.ranges, n, LINES=CHUNK // 128, num_warps=4)


def build_chain(layers, dev):
    """→ (ops: list of (name, fn(state) → None, weight tensors)), state dict). Each op reads its input from the state
    and writes its output there, so that the chain is one dependent sequence as in a decode step."""
    from flashnext.ops.hyper_connection import PendingInjection, hc_mix_injected
    from flashnext.ops.w4a16_tinygemm import tinygemm_matmul, to_tinygemm
    from flashnext.weights.int4_layout import quantize_rtn

    gen = torch.Generator(device=dev).manual_seed(0)
    width = HC * HIDDEN

    def bf16(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).bfloat16()

    def int4(n, k):
        return to_tinygemm(quantize_rtn(torch.randn(n, k, generator=gen, device=dev) / k ** 0.5, 128))

    state = {"h": bf16(1, width, scale=1.0), "bo": bf16(1, HIDDEN, scale=0.1),
             "w": torch.full((1, HC), 0.5, device=dev, dtype=torch.bfloat16)}
    ops = []

    def mix_op(tag):
        norm, down, up, inject = (bf16(width, scale=0.2), bf16(LOWRANK, width, scale=width ** -0.5),
                                  bf16(width, LOWRANK, scale=LOWRANK ** -0.5), bf16(HC, width, scale=width ** -0.5))

        def run(s):
            block_input, weights, h = hc_mix_injected(PendingInjection(s["h"], s["bo"], s["w"]), norm, down, up,
                                                      inject, HC, HIDDEN, EPS)
            s.update(x=block_input, w=weights, h=h)
        ops.append((tag, run, [norm, down, up, inject]))

    def gemv_op(tag, n, k, into):
        tw = int4(n, k)

        def run(s):
            s[into] = tinygemm_matmul(s["x"][:, :k], tw)
        ops.append((tag, run, [tw.packed, tw.scales_and_zeros]))

    for _ in range(layers):
        mix_op("mix")
        gemv_op("qkv|z", 16384, 2560, "x")
        gemv_op("out", 2560, 6144, "bo")
        mix_op("mix")
        gemv_op("shared gate|up", 1280, 2560, "x")
        gemv_op("shared down", 2560, 640, "bo")
    return ops, state


def capture(ops, state, prefetches, ahead):
    """One graph of the chain; with `prefetches`, op k+ahead's prefetch on a side branch once op k−1 is done."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    for _, run, _ in ops:   # warm every kernel before the capture
        run(state)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        for k, (_, run, _) in enumerate(ops):
            if prefetches is not None:
                event = torch.cuda.Event()
                event.record(main)
                side.wait_event(event)
                with torch.cuda.stream(side):
                    for j in range(k + 1 if k else 0, min(k + ahead, len(ops) - 1) + 1):
                        prefetches[j]()
            run(state)
        if prefetches is not None:
            main.wait_stream(side)
    return graph


def time_graph(graph, reps=50) -> float:
    """µs per replay, back to back (gpu_decode.replayed_ms)."""
    return replayed_ms(graph, steps=reps) * 1e3


def warm_op_us(run, state, reps=20):
    """One op repeated on its inputs of `state` (each repetition from a copy: an op may overwrite its input's key)."""
    graph = torch.cuda.CUDAGraph()
    run(dict(state))
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            run(dict(state))
    return time_graph(graph, reps=10) / reps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    args = parser.parse_args()
    dev = torch.device("cuda")
    ops, state = build_chain(args.layers, dev)
    weight_mb = sum(t.numel() * t.element_size() for _, _, ws in ops for t in ws) / 1e6
    print(f"{torch.cuda.get_device_name()}  {len(ops)} ops, {weight_mb:.0f} MB of weights")
    results = {}
    results["plain"] = time_graph(capture(ops, state, None, 0))
    for name, mode, ahead in (("ahead1", "bulk", 1), ("ahead2", "bulk", 2), ("line1", "line", 1)):
        prefetches = [Prefetch(ws, dev, mode) for _, _, ws in ops]
        try:
            results[name] = time_graph(capture(ops, state, prefetches, ahead))
        except Exception as error:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            print(f"{name}: FAILED {type(error).__name__}: {str(error)[:300]}")
    for name, us in results.items():
        print(f"{name:8} {us:9.1f} µs a chain ({us / len(ops):5.2f} a op; {weight_mb / us:5.2f} TB/s)", flush=True)
    kinds = {}
    for tag, run, ws in ops[:6]:
        kinds[tag] = kinds.get(tag, 0) + warm_op_us(run, state) * args.layers
        run(state)   # the next op's input
    warm_total = sum(kinds.values())
    print(f"{'warm sum':8} {warm_total:9.1f} µs (" + ", ".join(f"{k} {v / args.layers:.2f}" for k, v in kinds.items())
          + " µs a layer)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
