"""On the CPU: the graph pools' learning (cache/expert_graph_pool.py, the code the captured decode runs) replayed on
the calibrated routing trace, without a model — hit rate and PCIe traffic a token for a slot budget, against LRU
with every miss admitted (expert_trace.replay). Experts are a few bytes each here; the traffic is counted in
experts and converted with Flash-Next's 2.53 MB an expert.

A step reads its routed experts through the table as it stands when the step runs (a miss: read from host memory
over PCIe), then the pool gets the step's ids and learns as after a captured step on a CPU: a step's ids learned
at the next step's end, the copies that starts published at the one after (on the GPU a step or two later still). So this is the pools' best case
for lag; what it compares is admission: copies a layer and a step, policy.
Session 10 (12 layers, 1,000 tokens, 211 slots): LRU 86.6%, 163 MB a token; the pools at 10 copies a layer and
480 a step 82.1%, ~380 MB a token (each admitted miss crosses PCIe twice: read by the kernel, then copied); admitting
only experts missed twice recently (a doorkeeper) was worse, 69.4% and 489 MB (the trace reuses strongly).
Run: python3 scripts/expert_pool_replay.py [--layers 12] [--tokens 1000] [--slots 211]"""
import argparse
import time

import torch

from flashnext.cache import expert_graph_pool
from flashnext.cache.expert_cache import ExpertCacheStats, LayerExpertCache
from flashnext.cache.expert_graph_pool import GraphPool
from flashnext.cache.expert_trace import replay
from flashnext.cache.routing_trace import CalibratedRouting
from flashnext.models.layers.int4_experts import Int4Experts
from flashnext.weights.int4_layout import Int4Weight

EXPERT_MB = 2.53   # one Flash-Next INT4 expert (gate|up and down, codes and scales)


def tiny_experts(num_experts: int) -> Int4Experts:
    """Experts of 16 → 8 → 16 features: the pool's bookkeeping is the same at any size."""
    def stack(k, n, group):
        return Int4Weight(torch.zeros(num_experts, k // 8, n, dtype=torch.int32),
                          torch.ones(num_experts, k // group, n, dtype=torch.bfloat16), None, None, group)
    return Int4Experts(stack(16, 16, 16), stack(8, 16, 8))


def run(traces, num_experts: int, top_k: int, slots: int, policy: str) -> tuple[float, float, float]:
    """→ (hit rate, experts read from host a token, experts copied in a token) for the graph pools."""
    stats = ExpertCacheStats()
    layers = [LayerExpertCache(tiny_experts(num_experts), slots, policy, stats, torch.device("cpu"))
              for _ in traces]
    pool = GraphPool(layers, 1, top_k)
    hits = misses = 0
    tokens = len(traces[0])
    for t in range(tokens):
        for i, trace in enumerate(traces):
            ids = torch.tensor(trace[t])
            resident = pool.tables[i][ids] >= 0
            hits += int(resident.sum())
            misses += int((~resident).sum())
            pool.observed[i, :top_k] = ids
        pool.after_step(1)
    copied = stats.bytes_copied / layers[0].bytes_per_expert
    return hits / (hits + misses), misses / tokens, copied / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12, help="MoE layers replayed (Flash-Next has 48; the copies a "
                    "step are scaled to the layers)")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--slots", type=int, default=211, help="slots a layer (24 GiB over 48 layers: 211)")
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=10)
    args = ap.parse_args()
    traces = []
    for i in range(args.layers):
        routing = CalibratedRouting(args.experts, args.top_k, seed=i)
        traces.append([routing.choose() for _ in range(args.tokens)])
    lru_hits, lru_misses = map(sum, zip(*(replay(t, args.experts, args.slots, "lru") for t in traces)))
    lru_rate = lru_hits / (lru_hits + lru_misses)
    per_token = lru_misses / args.tokens
    print(f"{args.layers} layers × {args.tokens} tokens, {args.slots}/{args.experts} slots, top-{args.top_k}; "
          f"traffic per token scaled to 48 layers at {EXPERT_MB} MB an expert")
    scale = 48 / args.layers * EXPERT_MB
    print(f"| admission | hit rate | read from host / token | copied / token | PCIe MB / token (48 layers) |")
    print("|---|---|---|---|---|")
    print(f"| LRU, every miss copied in before use | {lru_rate:.1%} | 0 | {per_token:.1f} | {per_token * scale:.0f} |")
    for copies_per_layer, copies_per_step in ((2, 16), (10, 480), (4, 480), (10, 96)):
        for policy in ("lfu-decay", "lru"):
            expert_graph_pool.COPIES_PER_LAYER = copies_per_layer
            expert_graph_pool.MAX_COPIES_PER_STEP = max(copies_per_layer, copies_per_step * args.layers // 48)
            start = time.perf_counter()
            rate, read, copied = run(traces, args.experts, args.top_k, args.slots, policy)
            print(f"| graph pools, {copies_per_layer} a layer / {copies_per_step} a step, {policy} | {rate:.1%} | "
                  f"{read:.1f} | {copied:.1f} | {(read + copied) * scale:.0f} |"
                  f"  <!-- {time.perf_counter() - start:.1f} s -->")


if __name__ == "__main__":
    main()
