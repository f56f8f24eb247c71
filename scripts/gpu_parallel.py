"""On the 2-GPU machine: tensor / expert parallel over NCCL at real shapes equals one GPU, and what it is worth.

Model: a preset (default qwen3-next-80b) cut to --layers (default 4), random weights synthesised in memory on
each GPU (the same values everywhere: every tensor has its own seeded generator). For 1 GPU and each layout
(TP=2, EP=2, TP=2+EP=2) it prints the relative error of the prompt logits (a --prompt-token prompt) and of
--decode teacher-forced decode logits against 1 GPU, how many greedy tokens agree, and the decode speed of
--decode free greedy tokens (tokens/s, after a warm-up). Exits non-zero when a layout's error exceeds --tol.

    python3 scripts/gpu_parallel.py                    # bf16, 4 layers, 100-token prompt, 64 decode tokens
    python3 scripts/gpu_parallel.py --dtype float32    # tight check (rel ~1e-6 expected)
    python3 scripts/gpu_parallel.py --device cpu --preset tiny-qwen3-next --dtype float32   # smoke run, gloo

NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is set here, before anything loads NCCL.
"""
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"

import torch  # noqa: E402
from gpu_common import hang_watchdog, rel  # noqa: E402

LAYOUTS = [(2, 1), (1, 2), (2, 2)]   # (tensor parallel, expert parallel)


def build(opts, rank: int, world: int, tp: int, ep: int, weights=None):
    """The model on this rank's GPU, sharded for (tp, ep); `weights` reused across layouts."""
    from flashnext.models import build_model
    from flashnext.models.layers.rope import RotaryEmbedding
    from flashnext.parallel.shard import shard_model
    from flashnext.weights.config import parse_config
    from flashnext.weights.presets import get_preset
    from flashnext.weights.synth import synthesize_state_dict

    device = torch.device("cuda", rank) if opts.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, opts.dtype)
    raw = get_preset(opts.preset, layers=opts.layers)
    cfg = parse_config(raw)
    if weights is None:
        weights = synthesize_state_dict(raw, "bf16", seed=0, device=device, out_dtype=dtype)
    model = build_model(cfg, device="meta", dtype=dtype)
    derived = {k: v.to(device) for k, v in model.state_dict().items() if v.device.type != "meta"}
    model.load_state_dict({**weights, **derived}, strict=True, assign=True)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta).inv_freq.to(device)
    if world > 1:
        shard_model(model, rank, world, tp=tp, ep=ep)
    return model.eval(), weights


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model, prompt, forced, decode: int):
    """(prompt logits [T, V], teacher-forced decode logits [decode, V], free greedy tokens, decode tokens/s)."""
    from flashnext.models.session import Session

    dev = next(model.parameters()).device
    warm = Session(model, 64)
    warm.extend(prompt[:16].tolist())
    for _ in range(4):
        warm.extend([1])
    s = Session(model, len(prompt) + decode + 1)
    prompt_logits = s.extend(prompt.tolist(), all_logits=True).float().cpu()
    steps = [s.extend([t]).float().cpu() for t in forced] if forced is not None else []
    s = Session(model, len(prompt) + decode + 1)
    logits, tokens = s.extend(prompt.tolist()), []
    sync(dev)
    start = time.perf_counter()
    for _ in range(decode):
        tokens.append(int(logits.argmax()))
        logits = s.extend([tokens[-1]])
    sync(dev)
    speed = decode / (time.perf_counter() - start)
    return prompt_logits, torch.stack(steps) if steps else None, tokens, speed


def _rank(rank, world, opts, prompt, forced, out_dir):
    from flashnext.parallel.runtime import attach_broadcaster, send_stop, worker_loop

    weights = None
    for tp, ep in LAYOUTS:
        model, weights = build(opts, rank, world, tp, ep, weights)
        if rank == 0:
            hook = attach_broadcaster(model)
            result = measure(model, prompt, forced, opts.decode)
            hook.remove()
            send_stop(next(model.parameters()).device)
            torch.save(result, Path(out_dir) / f"tp{tp}-ep{ep}.pt")
        else:
            worker_loop(model, getattr(torch, opts.dtype), next(model.parameters()).device)
        del model
        if opts.device == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-next-80b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a gloo smoke run of this script")
    parser.add_argument("--tol", type=float, default=None, help="largest relative error (default 5e-2 bf16, 1e-4 fp32)")
    parser.add_argument("--hang-s", type=float, default=240, help="print every rank's stack and exit 3 after this long")
    opts = parser.parse_args()
    hang_watchdog(opts.hang_s)
    tol = opts.tol or (5e-2 if opts.dtype == "bfloat16" else 1e-4)
    if opts.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
        return 2
    from flashnext.parallel import spawn_ranks

    from flashnext.weights.config import parse_config
    from flashnext.weights.presets import get_preset

    vocab = parse_config(get_preset(opts.preset)).vocab_size
    prompt = torch.randint(3, vocab - 30, (opts.prompt,), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    model, weights = build(opts, 0, 1, 1, 1)
    print(f"{opts.preset} --layers {opts.layers} {opts.dtype}: synthesised on 1 {opts.device} in {time.perf_counter() - t0:.1f} s")
    ref_prompt, _, ref_tokens, ref_speed = measure(model, prompt, None, opts.decode)
    _, ref_steps, _, _ = measure(model, prompt, ref_tokens, opts.decode)
    del model, weights
    if opts.device == "cuda":
        torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        spawn_ranks(_rank, 2, opts, prompt, ref_tokens, out, device=opts.device)
        print(f"2-GPU layouts ran in {time.perf_counter() - t0:.1f} s (NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']})")
        results = {layout: torch.load(Path(out) / f"tp{layout[0]}-ep{layout[1]}.pt") for layout in LAYOUTS}

    print(f"\n| layout | GPUs | prompt logits rel | decode logits rel (forced) | greedy agree | decode tok/s ({opts.decode}) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    print(f"| single | 1 | - | - | - | {ref_speed:.1f} | 1.00 |")
    ok = True
    for (tp, ep), (p_logits, s_logits, tokens, speed) in results.items():
        e_prompt, e_steps = rel(p_logits, ref_prompt), rel(s_logits, ref_steps)
        agree = sum(a == b for a, b in zip(tokens, ref_tokens))
        ok &= e_prompt < tol and e_steps < tol
        print(f"| TP={tp} EP={ep} | 2 | {e_prompt:.2e} | {e_steps:.2e} | {agree}/{len(ref_tokens)} | {speed:.1f} | "
              f"{speed / ref_speed:.2f} |")
    print(f"\n{'PASS' if ok else 'FAIL'} (tolerance {tol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
