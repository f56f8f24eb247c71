"""On the 2-GPU machine: the captured decode step across ranks (engine/cuda_graph.py + parallel/runtime.py
broadcast_decode: every rank replays its own graph, NCCL all-reduces captured inside) gives the same greedy tokens
as one GPU's eager engine, fp32, tiny presets, tensor and expert parallel, staggered arrivals (mixed graph and
prefill steps). Exits non-zero on a mismatch. Speed: `flashnext bench decode --model DIR --server-args
"--expert-parallel 2"` against the same without it.
Run: python3 scripts/gpu_parallel_graphs.py"""
import os
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"
# fla's fp32 chunk kernels autotune for every head count (the halved ones under TP too): on a fresh machine that
# took the whole 180 s limit (session 5). The torch reference prefill runs on both sides; what is checked here is
# the graphs and the collectives, not the GDN kernel (scripts/gpu_gdn_prefill.py checks that).
os.environ.setdefault("FLASHNEXT_GDN_PREFILL", "reference")

from flashnext.engine.args import EngineArgs  # noqa: E402
from flashnext.engine.llm_engine import LLMEngine  # noqa: E402
from flashnext.engine.sampling_params import SamplingParams  # noqa: E402
from flashnext.parallel import launch_engine, shutdown  # noqa: E402
from gpu_common import agreeing_tokens, hang_watchdog  # noqa: E402

PROMPTS = [[(5 * i + 7 * j) % 470 + 3 for j in range(n)] for i, n in enumerate((6, 31, 17, 90))]


def run(engine):
    out = {str(i): [] for i in range(len(PROMPTS))}
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        for o in engine.step():
            out[o.request_id] += o.token_ids
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return out


def main() -> int:
    hang_watchdog(float(os.environ.get("HANG_S", "150")))
    ok = True
    for preset in ("tiny-flash-next", "tiny-qwen3-next"):
        args = dict(model=preset, device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                    max_model_len=512, kv_cache_gb=0.5)
        want = run(LLMEngine(EngineArgs(**args, enforce_eager=True)))
        print(f"{preset:16} one GPU, eager: done", flush=True)
        # Expert parallel first: it ran through the server on 2 x H200; this script (tensor parallel first) hung.
        for layout in (dict(expert_parallel=2), dict(tensor_parallel=2)):
            try:
                engine = launch_engine(EngineArgs(**args, **layout))
                got = run(engine)
                graphs = len(engine.runner.graphs.graphs) if engine.runner.graphs else 0
            finally:
                shutdown()
            same, total = agreeing_tokens(want, got)
            ok &= same == total and graphs > 0
            print(f"{preset:16} {layout}: graphs captured {graphs}, tokens equal to 1 GPU eager {same}/{total}"
                  f"{'' if same == total else '  MISMATCH'}", flush=True)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
