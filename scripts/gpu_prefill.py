"""On the GPU machine: where prefill time goes. One fresh prompt of each --tokens length is prefilled (one
generated token) at each --chunk size (the engine's max_num_batched_tokens), timed, then profiled by kernel.

Run: python3 scripts/gpu_prefill.py --model mem:flash-next --quantize int4 --tokens 10000 --tokens 90000 --chunk 8192
"""
import argparse
import random
import sys
import time

import torch

from flashnext.engine.llm import LLM
from flashnext.engine.sampling_params import SamplingParams
from gpu_decode import profile_kernels


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mem:flash-next")
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--tokens", type=int, action="append", default=[])
    ap.add_argument("--chunk", type=int, action="append", default=[])
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    chunks = args.chunk or [2048]
    lengths = args.tokens or [10000]
    llm = LLM(args.model, quantize=args.quantize, max_num_seqs=2, enable_prefix_caching=False, kv_cache_gb=16.0,
              max_num_batched_tokens=max(chunks))
    vocab = llm.engine.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)

    def prompt(tokens):
        return [rng.randrange(100, vocab - 100) for _ in range(tokens)]

    print(f"{'chunk':>6} {'tokens':>7} {'seconds':>8} {'tok/s':>8}")
    for tokens in lengths:
        for chunk in chunks:
            llm.engine.scheduler.token_budget = chunk
            # warm-up: compiles and autotunes (fla) the kernels; three chunks reach the long-context attention path
            llm.generate([prompt(min(tokens, 3 * chunk))], params)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate([prompt(tokens)], params)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            print(f"{chunk:6} {tokens:7} {dt:8.2f} {tokens / dt:8.0f}")
            if not args.no_profile:
                profile_kernels(lambda: llm.generate([prompt(tokens)], params), runs=1, top=25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
