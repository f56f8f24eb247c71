"""On the GPU machine: prefill steps through row-wise CUDA graphs (engine/row_graphs.py) against the eager forward,
step by step — the logits' and the states' largest relative difference — for a conversation's first prompt and its
follow-up chunks (then gpu_decode.py's follow-up turns, eager against graphs), with one sequence's plans (GatedDeltaNet's mixing captured too) and with that mixing eager (the
plans of several sequences). What tests/test_row_graphs.py checks on the CPU, here with the graphs captured.

    python3 scripts/gpu_row_graphs.py [--preset tiny-flash-next] [--dtype float32]
"""
import argparse
import sys

import torch

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.state_pool import StatePool
from flashnext.engine.args import EngineArgs
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.row_graphs import RowGraphs
from flashnext.models.context import ForwardContext, Segment


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-flash-next")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda", help="cpu: the same comparison uncaptured (a dry run)")
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs(model=args.preset, dtype=args.dtype, quantize="int4", enforce_eager=True,
                                  device=args.device,
                                  max_num_seqs=2, kv_cache_gb=0.5, warmup=False))
    model, cfg, dtype = engine.loaded.model, engine.config, engine.dtype
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for single in (True, False):
        pools = [(KVPool(cfg, 256, engine.kv.block_size, dtype, args.device), StatePool(cfg, 2, dtype, args.device))
                 for _ in range(2)]
        table = [p[0].allocate(200) for p in pools][0]
        slot = [p[1].allocate() for p in pools][0]
        graphs = RowGraphs(args.device, 512)
        done = 0
        print(f"{'one sequence' if single else 'several (mixing eager)'}: rows, context, logits rel, states rel")
        with torch.inference_mode():
            for n in (40, 21, 25, 49, 87, 140, 49, 140):
                ids = torch.randint(5, cfg.vocab_size, (n,), generator=g).to(args.device)
                logits = []
                for (kv, states), plan in ((pools[0], None), (pools[1], graphs.plan(n, slot if single else None))):
                    seg = Segment(slot, torch.tensor(table, device=args.device), 0, n, done)
                    hidden = model(ids, ForwardContext([seg], kv, states, pieces=plan))
                    if plan is not None:
                        plan.end()
                    logits.append(model.compute_logits(hidden[n - 1: n]))
                states = max(rel(pools[1][1].tensors()[k][slot], t[slot]) for k, t in pools[0][1].tensors().items()
                             if not k.startswith("index_ring"))
                err = rel(logits[1], logits[0])
                worst = max(worst, err, states)
                print(f"  {n:4d} {done:5d} {err:.2e} {states:.2e}  argmax {int(logits[0].argmax())} "
                      f"{int(logits[1].argmax())}")
                done += n
    print(f"worst {worst:.2e}")
    from gpu_decode import follow_ups

    (want, _), (got, chained) = follow_ups(args.preset, eager=True), follow_ups(args.preset, eager=False)
    print(f"follow-up turns through the engine ({chained} chained graphs, the longer chunks row-wise): "
          f"{'equal' if want == got else 'MISMATCH'}")
    return 0 if worst < 1e-3 and want == got else 1


if __name__ == "__main__":
    sys.exit(main())
