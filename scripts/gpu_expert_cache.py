"""On the GPU machine: the expert cache (--expert-vram-gb) gives the all-resident logits bit for bit, with and
without prefetch, at small slot budgets, fp32 and bf16 (tiny presets: 8 experts, top-2, 4 layers), and its counters
add up; then through the engine, whose decode steps run in CUDA graphs reading the pools through their slot tables
and missing experts from pinned host memory (cache/expert_graph_pool.py): greedy tokens of three prompts equal the
all-resident engine's (fp32), and the pools adapted between steps. Exits non-zero on a mismatch. Speed: `flashnext bench experts --model mem:flash-next --server-args
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
    from flashnext.engine.llm import LLM
    from flashnext.engine.sampling_params import SamplingParams

    prompts = [[random.Random(i).randrange(3, 480) for _ in range(30 + 7 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for name in ("tiny-flash-next", "tiny-qwen3-next"):
        for budget in (None, 4e-5, 1e-4):   # all resident; 3 and 7 of 8 slots a layer on these presets
            llm = LLM(name, dtype="float32", quantize="int4", expert_vram_gb=budget, max_num_seqs=4,
                      enable_prefix_caching=False, kv_cache_gb=0.5)
            tokens = [c.token_ids for c in llm.generate(prompts, params)]
            if budget is None:
                want = tokens
                continue
            cache, graphs = llm.engine.loaded.expert_cache, llm.engine.runner.graphs
            st = cache.stats
            same = tokens == want
            ok &= same and graphs is not None and any(g is not None for g, _ in graphs.graphs.values())
            print(f"{name:16} engine, graphs, {cache.slots_per_layer} slots a layer: "
                  f"{'equal' if same else 'MISMATCH'} to all-resident; captured {len(graphs.graphs)} steps; "
                  f"hits {st.hits} misses {st.misses} copied {st.bytes_copied} bytes")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
