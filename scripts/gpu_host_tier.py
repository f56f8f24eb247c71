"""On the GPU machine: replies through the host tier of the prefix cache equal a cold engine's.

The host tier on a GPU holds page-locked buffers from its arena, copied down and up asynchronously (cache/host_tier.py,
cache/pinned_arena.py), which the CPU tests do not run. Here tiny presets on the GPU (fp32, decode graphs on) run
interleaved conversations under a KV pool of a few dozen blocks and a small host tier, so that every turn evicts and
most resume from the host: each reply must equal a cold engine's (no prefix cache) on the same prompt, and entries must
have come back from the host tier.
Run: python3 scripts/gpu_host_tier.py [PRESET ...]   (default tiny-flash-next tiny-qwen3-next; exits 1 on a mismatch)
"""
import random
import sys

from flashnext.engine.args import EngineArgs
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def reply(engine: LLMEngine, prompt: list[int], rid: str) -> tuple[list[int], int]:
    request = engine.add_request(rid, prompt, PARAMS)
    tokens = []
    while engine.has_work():
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
    return tokens, request.num_cached


def check(preset: str) -> bool:
    base = dict(model=preset, device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                max_model_len=400, prefix_snapshot_interval=32)
    cold = LLMEngine(EngineArgs(**base, kv_cache_gb=0.5, enable_prefix_caching=False))
    per_block = cold.kv.bytes_per_block(cold.config, cold.kv.block_size, cold.dtype)
    engine = LLMEngine(EngineArgs(**base, kv_cache_gb=40 * per_block / 2**30, kv_host_gb=0.05), loaded=cold.loaded)
    rng = random.Random(10)
    convs = {i: [rng.randrange(3, 480) for _ in range(rng.randrange(40, 120))] for i in range(5)}
    ok, turns, cached_total = True, 0, 0
    for turn in range(4):
        for i in range(5):
            prompt = convs[i]
            got, cached = reply(engine, prompt, f"{i}.{turn}")
            want, _ = reply(cold, prompt, f"cold.{i}.{turn}")
            ok &= got == want
            turns += 1
            cached_total += cached
            convs[i] = prompt + got + [rng.randrange(3, 480) for _ in range(rng.randrange(1, 20))]
    host = engine.prefix_cache.lower
    restored = engine.prefix_cache.restored_tokens["host"]
    ok &= restored > 0
    print(f"{preset:16} {turns} turns: replies {'equal' if ok else 'DIFFER'} to a cold engine's; {cached_total} tokens "
          f"cached, {restored} restored from the host tier ({len(host.snaps)} entries there)")
    return ok


def main() -> int:
    presets = sys.argv[1:] or ["tiny-flash-next", "tiny-qwen3-next"]
    ok = all([check(p) for p in presets])
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
