"""On the GPU machine: the expert cache (--expert-vram-gb) gives the all-resident logits bit for bit, with and
without prefetch, at small slot budgets, fp32 and bf16 (tiny presets: 8 experts, top-2, 4 layers), and its counters
add up. Exits non-zero on a mismatch. Speed: `flashnext bench experts --model mem:flash-next --server-args
"--quantize int4 --routing-trace calibrated --expert-vram-gb 24"` (docs/expert_cache.md).
Run: python3 scripts/gpu_expert_cache.py"""
import random
import sys

import torch

from flashnext.cache.expert_cache import install_expert_cache
from flashnext.engine.loading import load_model
from flashnext.models.session import Session


def greedy(model, n=24):
    rng = random.Random(0)
    s = Session(model, 256)
    logits = [s.extend([rng.randrange(3, 480) for _ in range(41)], all_logits=True)]
    for _ in range(n):
        logits.append(s.extend([int(logits[-1][-1].argmax())])[None])
    return torch.cat(logits)


def main() -> int:
    ok = True
    for name in ("tiny-flash-next", "tiny-qwen3-next"):
        for dtype in (torch.float32, torch.bfloat16):
            want = greedy(load_model(name, "cuda", dtype, quantize="int4").model)
            for slots in (2, 3, 5):
                for prefetch in (False, True):
                    model = load_model(name, "cuda", dtype, quantize="int4").model
                    cache = install_expert_cache(model, slots_per_layer=slots, prefetch=prefetch)
                    got = greedy(model)
                    st = cache.stats
                    same = torch.equal(got, want)
                    ok &= same and st.prefetch_used <= st.prefetched
                    print(f"{name:16} {str(dtype):15} slots {slots} prefetch {prefetch!s:5}: "
                          f"{'equal' if same else 'MISMATCH'} to all-resident; hits {st.hits} misses {st.misses} "
                          f"prefetched {st.prefetched} used {st.prefetch_used}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
