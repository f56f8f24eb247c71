"""On the GPU machine: the captured decode step (engine/cuda_graph.py) — exact, then how fast.

1. Exactness: for each tiny preset, fp32, with and without --quantize int4, three prompts decoded together
   (a padded batch bucket) greedily for 96 tokens: the CUDA-graph path must give the same tokens as
   --enforce-eager (the torch reference). bf16 agreement is printed too (different kernels round differently).
2. Speed: for each --model, one sequence: ms per decode step replayed from the graph (and from the same step
   captured with programmatic dependent launch off, ops/pdl.py) vs the eager torch path, and the whole engine
   loop's tokens/s (sampling, scheduling, detokenising included), at short context; GPU time per kernel, and the
   kernels of two layers in order.
3. Batches (--batch N ..., with --context T): the captured step of N sequences each T tokens deep, on slots and
   KV blocks of their own (zero states, unwritten KV, a random token per row so the rows route apart), its ms and the GPU
   time per kernel — what a step of concurrent long streams spends (issue #11).
Exits non-zero on a mismatch. Run: python3 scripts/gpu_decode.py [--model NAME ...] [--quantize int4]
[--variant FLASHNEXT_DECODE_BRANCHES=1 ...] (A/B of switches read at capture, without rebuilding the model)
[--batch 1 --batch 8 --context 65536]
"""
import argparse
import sys
import time

import torch

from flashnext.engine.cuda_graph import MIN_WIDTH, bucket
from flashnext.engine.llm import LLM
from flashnext.engine.sampling_params import SamplingParams
from gpu_common import agreeing_tokens, environment, pdl_off

PRESETS = ["tiny-flash-next", "tiny-qwen3-next", "tiny-qwen3.5-moe"]
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), list(range(100, 111))]


def greedy(model, dtype, quantize, eager, n=96, device="cuda"):
    llm = LLM(model, dtype=dtype, quantize=quantize, enforce_eager=eager, max_num_seqs=4, enable_prefix_caching=False,
              kv_cache_gb=1.0, device=device)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = [c.token_ids for c in llm.generate(PROMPTS, params)]
    graphs = llm.engine.runner.graphs
    return out, (len(graphs.graphs) if graphs else 0)


def exactness(dtypes=("float32", "bfloat16"), presets=PRESETS) -> bool:
    ok = True
    print(f"{'preset':18} {'weights':7} {'dtype':8} {'graphs':>6} {'equal tokens':>14}")
    for name in presets:
        for quantize in (None, "int4"):
            for dtype in dtypes:
                ref, _ = greedy(name, dtype, quantize, eager=True)
                got, captured = greedy(name, dtype, quantize, eager=False)
                same, total = agreeing_tokens(ref, got)
                exact = dtype == "float32"
                ok &= captured > 0 and (same == total or not exact)
                print(f"{name:18} {quantize or 'bf16':7} {dtype:8} {captured:6} {same:>6}/{total:<6}"
                      f"{'' if same == total else ('  MISMATCH' if exact else '  (bf16: informational)')}")
    # The proof: the GPU fast path (graphs + Triton kernels) against the torch reference on the CPU.
    for name in presets:
        for quantize in (None, "int4"):
            ref, _ = greedy(name, "float32", quantize, eager=True, device="cpu")
            got, _ = greedy(name, "float32", quantize, eager=False)
            same, total = agreeing_tokens(ref, got)
            ok &= same == total
            print(f"{name:18} {quantize or 'bf16':7} GPU fast path vs CPU torch reference, fp32: {same}/{total}"
                  f"{'' if same == total else '  MISMATCH'}")
    for name in presets:
        equal = staggered(name, eager=False) == staggered(name, eager=True)
        ok &= equal
        print(f"{name:18} staggered arrivals (mixed graph/eager steps), fp32: {'equal' if equal else 'MISMATCH'}")
    for name in presets:
        (want, _), (got, chained) = follow_ups(name, eager=True), follow_ups(name, eager=False)
        ok &= want == got and chained > 0
        print(f"{name:18} int4    follow-up turns through chained steps ({chained} graphs), fp32: "
              f"{'equal' if want == got else 'MISMATCH'}")
    return ok


def follow_ups(model: str, eager: bool) -> tuple[list, int]:
    """A conversation whose turns hit the prefix cache and add 9–128 tokens (and the last turn's reply): with graphs
    those chunks replay chained steps (DecodeGraphs.extend; INT4 experts). → (each turn's tokens and cached count,
    chained graphs)."""
    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=model, dtype="float32", quantize="int4", enforce_eager=eager, max_num_seqs=4,
                                  max_num_batched_tokens=256, kv_cache_gb=1.0, decode_ahead=False))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt, tokens, turns = list(range(10, 50)), [], []
    for turn, new in enumerate((0, 9, 13, 37, 75, 128)):   # the first turn: the prompt alone
        prompt = prompt + tokens + [(7 * turn + 3 * i) % 300 + 5 for i in range(new)]
        request = engine.add_request(f"t{turn}", prompt, params)
        tokens = []
        while engine.has_work():
            for o in engine.step():
                tokens += o.token_ids
        turns.append((tokens, request.num_cached))
    graphs = engine.runner.graphs
    return turns, 0 if graphs is None else len(graphs.chain_graphs)


def staggered(model: str, eager: bool) -> dict:
    """Requests arriving while others decode: steps mix graph decodes with eager prefill chunks."""
    from flashnext.engine.args import EngineArgs
    from flashnext.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=model, dtype="float32", enforce_eager=eager, max_num_seqs=6,
                                  max_num_batched_tokens=16, kv_cache_gb=1.0, enable_prefix_caching=False))
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate((9, 30, 5, 17, 2))]
    arrivals, out, step = [0, 0, 3, 7, 8], {str(i): [] for i in range(5)}, 0
    while step <= max(arrivals) or engine.has_work():
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(str(i), prompts[i], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        for o in engine.step():
            out[o.request_id] += o.token_ids
        step += 1
    return out


def timing(model_name: str, quantize: str | None, variants: list[dict[str, str]] = (), steps: int = 200):
    llm = LLM(model_name, quantize=quantize, max_num_seqs=4, enable_prefix_caching=False, kv_cache_gb=8.0)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # captures graphs
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = llm.generate([PROMPTS[1]], params)[0]
    torch.cuda.synchronize()
    loop_tps = len(out.token_ids) / (time.perf_counter() - start)
    graphs = engine.runner.graphs
    graph, _ = graphs.graphs[(1, 16)]
    # The bare step: replay only (the inputs of the last step stay in the static buffers).
    replay_ms = replayed_ms(graph)
    # One replay at a time, as the engine loop runs it (it waits for each step's token): what a replay costs
    # from an idle GPU, against the back-to-back rate above.
    t0 = time.perf_counter()
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
    print(f"  graph replay with a sync after each: {(time.perf_counter() - t0) / 50 * 1e3:.3f} ms "
          f"(back to back: {replay_ms:.3f} ms)")
    replay_ms_without_pdl = replay_without_pdl(graphs)
    for variant in variants:   # the same step captured again under other switches (one model build for all)
        with environment(variant):
            print(f"  variant {label(variant)}: "
                  f"{recaptured_ms(graphs):.3f} ms per replay back to back")
    again_ms = recaptured_ms(graphs)   # the default step again, for the eager timing below
    if variants:   # an A-B-A: what a capture's order alone does shows against the first default
        print(f"  default, captured again after the variants: {again_ms:.3f} ms per replay back to back")
    batch = graphs.batch(1, 16)
    with torch.inference_mode():
        for _ in range(2):
            engine.loaded.model.compute_logits(engine.loaded.model.decode(batch))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            engine.loaded.model.compute_logits(engine.loaded.model.decode(batch))
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - t0) / 10 * 1e3
        profile_kernels(lambda: engine.loaded.model.compute_logits(engine.loaded.model.decode(batch)))
    return replay_ms, replay_ms_without_pdl, eager_ms, loop_tps, engine.loaded.weight_bytes


def batch_timing(model_name: str, quantize: str | None, sizes: list[int], context: int,
                 variants: list[dict[str, str]] = ()) -> None:
    """The captured step of n sequences `context` tokens deep, for each n in sizes (see the module's 3.), and the
    same step captured again under each variant's switches."""
    largest = max(sizes)
    llm = LLM(model_name, quantize=quantize, max_num_seqs=largest, enable_prefix_caching=False, warmup=False,
              kv_cache_gb=None)
    engine = llm.engine
    graphs, kv, states = engine.runner.graphs, engine.kv, engine.states
    blocks_each = kv.blocks_for(context)
    assert graphs is not None and blocks_each <= graphs.max_width, "needs decode graphs and context <= max_model_len"
    vocab = engine.config.vocab_size
    print(f"\n{model_name}: {largest} x {context} tokens need {largest * blocks_each} KV blocks of {kv.num_blocks}")
    print(f"{'batch':>5} {'graph ms/step':>13} {'per-stream tok/s':>16} {'aggregate tok/s':>15}")
    for n in sizes:
        slots = [states.allocate() for _ in range(n)]
        tables = [kv.allocate(blocks_each) for _ in range(n)]
        # a token of its own per row: equal rows (zero states and KV) would route alike, the MoE reading k experts a
        # layer instead of the union of n rows' (72 of 512 for 8 random rows, scripts/gpu_moe.py)
        tokens = torch.randint(vocab // 4, vocab // 2, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        size, width = bucket(n), bucket(blocks_each, MIN_WIDTH)

        def step_ms() -> float:
            with torch.inference_mode():   # captures (batch, width) if needed and fills the static inputs
                graphs.run(tokens, [context - 1] * n, slots, tables)
            torch.cuda.synchronize()
            return replayed_ms(graphs.graphs[(size, width)][0])

        ms = step_ms()
        print(f"{n:5} {ms:13.3f} {1e3 / ms:16.1f} {n * 1e3 / ms:15.1f}")
        for variant in variants:
            with environment(variant):
                variant_ms = recapture(graphs, (size, width), step_ms)
            print(f"{'':5} {variant_ms:13.3f} {1e3 / variant_ms:16.1f} {n * 1e3 / variant_ms:15.1f}  {label(variant)}")
        if variants:   # the default step again (an A-B-A: a capture's order shows against the first), for the profile
            print(f"{'':5} {recapture(graphs, (size, width), step_ms):13.3f} {'':16} {'':15}  default, captured again")
        with torch.inference_mode():
            profile_kernels(lambda: graphs._step(size, width), top=15)
        for slot, table in zip(slots, tables):
            states.release(slot)
            kv.release(table)


def label(variant: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in variant.items())


def replayed_ms(graph, steps: int = 50) -> float:
    """ms per replay of `graph`, back to back, after 5 warm-up replays."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def recapture(graphs, key: tuple[int, int], capture):
    """capture() → its result, the graph of `key` captured again by it (under whatever switches are set now). The
    old graph stays alive until the new one is captured: were it the only graph of the shared memory pool, freeing
    it first frees the pool, and capturing into its handle then fails (CUDACachingAllocator: use_count > 0)."""
    replaced = graphs.graphs.pop(key)
    try:
        return capture()
    finally:
        del replaced


def recaptured_ms(graphs) -> float:
    """ms per replay of the batch-1 step captured again. The capture points the static inputs at the scratch slot, as
    every capture does; the eager timing after reads those."""
    recapture(graphs, (1, 16), lambda: graphs._capture(1, 16))
    return replayed_ms(graphs.graphs[(1, 16)][0])


def replay_without_pdl(graphs) -> float:
    """ms per replay of the batch-1 step captured again with programmatic dependent launch off (ops/pdl.py)."""
    with pdl_off():
        return recaptured_ms(graphs)


def profile_kernels(step, runs: int = 3, top: int = 30):
    """GPU time per kernel over `runs` eager steps (the same kernels the graph replays, without launch gaps), and
    the kernels of layers 2 and 3 in order (a GatedDeltaNet and an attention layer of Flash-Next): which glue
    sits between the fused kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            step()
        torch.cuda.synchronize()
    # Only device events: key_averages also lists the host's launch calls (cudaLaunchKernel, ...) with no GPU time.
    rows = [(e.key, e.device_time_total / runs, e.count // runs) for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(t for _, t, _ in rows)
    print(f"  GPU time per step by kernel: {total / 1e3:.3f} ms in {sum(c for _, _, c in rows)} kernels")
    for name, t, count in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"    {t / 1e3:8.3f} ms {100 * t / total:5.1f}%  x{count:<5} {name[:90]}")
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    mixes = [i for i, e in enumerate(kernels) if "_hc_down_kernel" in e.name]
    if len(mixes) > 8:
        print("  layers 2 and 3 of the first step, in order (µs on the GPU):")
        for e in kernels[mixes[4]:mixes[8]]:
            print(f"    {e.time_range.elapsed_us():7.1f}  {e.name[:100]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--fp32-only", action="store_true", help="exactness in float32 only (the bf16 rows are informational)")
    ap.add_argument("--preset", action="append", choices=PRESETS, help="exactness for these tiny presets only")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                    help="also time the step captured again with these environment switches (those read at launch "
                         "or capture, e.g. FLASHNEXT_DECODE_BRANCHES=1); repeatable, one model build for all")
    ap.add_argument("--batch", type=int, action="append", default=[],
                    help="also time the captured step of this many sequences --context tokens deep (repeatable)")
    ap.add_argument("--context", type=int, default=65536, help="context depth of the --batch sequences")
    args = ap.parse_args()
    variants = [dict(pair.split("=", 1) for pair in v.split(",")) for v in args.variant]
    ok = True if args.skip_exactness else exactness(("float32",) if args.fp32_only else ("float32", "bfloat16"),
                                                    args.preset or PRESETS)
    if args.model:
        print(f"\n{'model':40} {'graph ms/step':>13} {'without PDL':>11} {'eager ms/step':>13} {'graph tok/s':>11} "
              f"{'engine tok/s':>12} {'weights GB':>10}")
    for name in args.model:
        if args.batch:
            batch_timing(name, args.quantize, args.batch, args.context, variants)
            continue
        replay_ms, without_pdl, eager_ms, loop_tps, nbytes = timing(name, args.quantize, variants)
        print(f"{name:40} {replay_ms:13.3f} {without_pdl:11.3f} {eager_ms:13.3f} {1e3 / replay_ms:11.1f} "
              f"{loop_tps:12.1f} {nbytes / 1e9:10.2f}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
