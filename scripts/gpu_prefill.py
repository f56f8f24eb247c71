"""On the GPU machine: where prefill time goes. One fresh prompt of each --tokens length is prefilled (one
generated token) at each --chunk size (the engine's max_num_batched_tokens), timed, then profiled by kernel.

Run: python3 scripts/gpu_prefill.py --model mem:flash-next --quantize int4 --tokens 10000 --tokens 90000 --chunk 8192

--variant NAME=VALUE[,NAME=VALUE] (repeatable) times each prompt again under switches read at call time (e.g.
FLASHNEXT_MOE_PREFILL=dequant), or `rows=off` (no row-wise graphs: --graph-prefill-max 0), on the same model; the
profile is of the default.

--compare also generates a few greedy tokens from one fixed prompt of each length under each variant and says whether
they equal the default's (switches that must not change a bit).

--host also profiles the host: where it waits for the GPU (each sync's source line, by CPU time) and the wall
time against the GPU's busy time, which shows how much of the prefill is the host's.
"""
import argparse
import random
import sys
import time

import torch

from flashnext.engine.llm import LLM
from flashnext.engine.sampling_params import SamplingParams
from gpu_common import environment, row_graphs_off, sync
from gpu_decode import label, profile_kernels


# The runtime's calls that wait for the GPU (their CPU time is the wait); they carry no Python stack, so each is
# put under the nearest torch op above it that has one (a scalar read, an output sized by data, a copy to the host).
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _source(event) -> str:
    """The flashnext (or fla) frames of the nearest enclosing op with a Python stack."""
    while event is not None:
        frames = [f for f in (event.stack or []) if "flashnext" in f or "fla/" in f][:3]
        if frames:
            return f"{event.name} <- " + " <- ".join(frames)
        event = event.cpu_parent
    return "(no flashnext frame)"


def host_waits(run, top: int = 12):
    """One run profiled on host and device: wall against the GPU's busy time (kernels and copies merged), and the
    host's waits for the GPU by source line (the flashnext frames of each wait's stack)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        run()
        sync()
    wall = time.perf_counter() - t0
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, end = 0, None
    for start, stop in spans:
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    print(f"  host view: wall {wall * 1e3:.1f} ms (profiled), GPU busy {busy / 1e3:.1f} ms, idle {wall * 1e3 - busy / 1e3:.1f} ms")
    waits = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA or e.name not in WAITS:
            continue
        key = (e.name, _source(e.cpu_parent))
        total, count = waits.get(key, (0.0, 0))
        waits[key] = (total + e.cpu_time_total, count + 1)
    print(f"  host waits by source (ms, count): {sum(t for t, _ in waits.values()) / 1e3:.1f} ms in all")
    for (name, where), (t, count) in sorted(waits.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {t / 1e3:8.2f} x{count:<5} {name}: {where[:200]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mem:flash-next")
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--tokens", type=int, action="append", default=[])
    ap.add_argument("--chunk", type=int, action="append", default=[])
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--host", action="store_true", help="also profile the host's waits for the GPU")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="with the prefix cache on, as the server runs (its snapshots and hashing; no hits: fresh prompts)")
    ap.add_argument("--compare", action="store_true",
                    help="also check that each variant's greedy tokens from one fixed prompt equal the default's")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                    help="also time each prompt under these environment switches (those read at call time)")
    args = ap.parse_args()
    variants = [{}] + [dict(pair.split("=", 1) for pair in v.split(",")) for v in args.variant]
    chunks = args.chunk or [2048]
    lengths = args.tokens or [10000]
    llm = LLM(args.model, quantize=args.quantize, max_num_seqs=2, enable_prefix_caching=args.prefix_caching,
              kv_cache_gb=16.0, max_num_batched_tokens=max(chunks))
    vocab = llm.engine.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)

    def prompt(tokens):
        return [rng.randrange(100, vocab - 100) for _ in range(tokens)]

    print(f"{'chunk':>6} {'tokens':>7} {'seconds':>8} {'tok/s':>8}")
    same = True
    for tokens in lengths:
        for chunk in chunks:
            llm.engine.scheduler.token_budget = chunk
            if args.compare:
                same &= compare_variants(llm, prompt(tokens), variants, f"{tokens} tokens, chunk {chunk}")
            for variant in variants:
                with under(llm, variant):
                    # warm-up at the full length: compiles and autotunes (fla) every kernel variant the prompt meets
                    # (the QSA list kernels compile one per power of two of the context's blocks)
                    llm.generate([prompt(tokens)], params)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    llm.generate([prompt(tokens)], params)
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                print(f"{chunk:6} {tokens:7} {dt:8.2f} {tokens / dt:8.0f}  {label(variant)}")
            if not args.no_profile:
                profile_kernels(lambda: llm.generate([prompt(tokens)], params), runs=1, top=25)
            if args.host:
                host_waits(lambda: llm.generate([prompt(tokens)], params))
    return 0 if same else 1


def under(llm, variant: dict[str, str]):
    """The context a variant runs in: `rows=off` (no row-wise graphs), else its environment switches."""
    return row_graphs_off(llm.engine) if variant == {"rows": "off"} else environment(variant)


def compare_variants(llm, fixed_prompt, variants, what: str, new_tokens: int = 8) -> bool:
    """Greedy tokens from `fixed_prompt` under each variant against the default's; prints one line a variant."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = []
    for variant in variants:
        with under(llm, variant):
            outputs.append(llm.generate([fixed_prompt], params)[0].token_ids)
    ok = True
    for variant, tokens in zip(variants[1:], outputs[1:]):
        equal = tokens == outputs[0]
        ok &= equal
        print(f"  compare {what}: {label(variant)} {'equal' if equal else 'DIFFERENT'} ({tokens} vs {outputs[0]})")
    return ok


if __name__ == "__main__":
    sys.exit(main())
