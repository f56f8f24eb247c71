"""On the GPU machine: replies through the host tier of the prefix cache equal a cold engine's.

On a GPU the host tier keeps page-locked buffers from its arena (cache/pinned_arena.py) and copies entries up
without a host wait (cache_entry.write_blocks, copy_tensors), which the CPU tests do not run. Here tiny presets on the
GPU (fp32, decode graphs on) run interleaved conversations under a KV pool of 40 blocks and a host tier of about six
entries, with the idle copy run between some turns (a piece at a time), so that turns evict, resume from the host
tier, and the host tier evicts in turn. Each reply must equal a cold engine's (no prefix cache) on the same prompt;
at least a third of the turns must resume from the host tier; the host tier must have let entries go; and after
clear() no KV block, state slot or host byte may be left.
Run: python3 scripts/gpu_host_tier.py [PRESET ...]   (default tiny-flash-next tiny-qwen3-next; exits 1 on a failure)
"""
import random
import sys

from flashnext.engine.args import EngineArgs
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def reply(engine: LLMEngine, prompt: list[int], rid: str) -> list[int]:
    engine.add_request(rid, prompt, PARAMS)
    tokens = []
    while engine.has_work():
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
    return tokens


def check(preset: str) -> bool:
    base = dict(model=preset, device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                max_model_len=400, prefix_snapshot_interval=32)
    cold = LLMEngine(EngineArgs(**base, kv_cache_gb=0.5, enable_prefix_caching=False))
    per_block = cold.kv.bytes_per_block(cold.config, cold.kv.block_size, cold.dtype)
    entry = cold.states.bytes_per_slot(cold.config, cold.dtype) + 8 * per_block   # a snapshot and ~8 blocks
    engine = LLMEngine(EngineArgs(**base, kv_cache_gb=40 * per_block / 2**30, kv_host_gb=6 * entry / 2**30),
                       loaded=cold.loaded)
    cache = engine.prefix_cache
    rng = random.Random(10)
    convs = {i: [rng.randrange(3, 480) for _ in range(rng.randrange(40, 120))] for i in range(5)}
    equal, turns, from_host, dropped = True, 0, 0, 0
    for turn in range(4):
        for i in range(5):
            prompt = convs[i]
            restored = cache.restored_tokens["host"]
            held = set(cache.lower.snaps)
            got = reply(engine, prompt, f"{i}.{turn}")
            equal &= got == reply(cold, prompt, f"cold.{i}.{turn}")
            turns += 1
            from_host += cache.restored_tokens["host"] > restored
            dropped += len(held - set(cache.lower.snaps) - set(cache.lru))
            if (turn + i) % 3 == 0:
                while engine.idle_work():
                    pass
            convs[i] = prompt + got + [rng.randrange(3, 480) for _ in range(rng.randrange(1, 20))]
    cache.clear()
    reserved = 0 if engine.runner.graphs is None else 1   # decode graphs keep a scratch slot and block for good
    leaks = (engine.kv.num_free + reserved != engine.kv.num_blocks,
             engine.states.num_free + reserved != engine.states.num_slots, cache.lower.bytes != 0)
    ok = equal and from_host * 3 >= turns and dropped > 0 and not any(leaks)
    print(f"{preset:16} {turns} turns: replies {'equal' if equal else 'DIFFER'} to a cold engine's; {from_host} resumed "
          f"from the host tier, {dropped} host entries let go; after clear(): "
          f"{'nothing left' if not any(leaks) else f'LEFT (KV, states, host bytes): {leaks}'}  {'ok' if ok else 'FAIL'}")
    return ok


def main() -> int:
    presets = sys.argv[1:] or ["tiny-flash-next", "tiny-qwen3-next"]
    ok = all([check(p) for p in presets])
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
