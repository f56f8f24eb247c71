"""GatedDeltaNet decode kernels on the GPU: correctness against the torch reference and timings at real shapes.

    python scripts/gpu_gdn_decode.py       # one table, ~20 s on an H200

For each (model, B) it runs one step of the Triton kernels (the conv kernel, then the delta-rule kernel) and of
gdn_decode_reference on copies of the same random states (bf16 activations, fp32 S) and compares the output and
both states, then times the Triton step with triton.testing.do_bench (eager launches) and do_bench_cudagraph (the
step replayed in a graph: the decode engine's situation), for the default num_warps of the delta-rule kernel and
the best of a few. Bytes = S read and written (fp32) + the conv tail read and written; GB/s is compared with the
4.27 TB/s device-to-device copy ceiling (PERF.md). The last column is the torch reference, eager, for scale.
"""
from __future__ import annotations

import sys

import torch

COPY_CEILING = 4.27e12
# (name, Hk, Hv, Dk, Dv, conv width, gate activation)
MODELS = [
    ("flash-next", 16, 48, 128, 128, 4, "sigmoid"),
    ("qwen3-next", 16, 32, 128, 128, 4, "silu"),
]
BATCHES = [1, 4, 8]
NUM_SLOTS = 17
WARPS = (4, 8, 16)


def make_problem(hk, hv, dk, dv, width, rows, gen, dev):
    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    channels = 2 * hk * dk + hv * dv
    inputs = {
        "mixed_qkv": rand(rows, channels), "z": rand(rows, hv, dv), "b": rand(rows, hv), "a": rand(rows, hv),
        "conv_state": rand(NUM_SLOTS, width - 1, channels), "conv_weight": rand(channels, width, scale=width ** -0.5),
        "ssm_state": rand(NUM_SLOTS, hv, dk, dv, scale=0.3, dtype=torch.float32),
        "slots": torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(rows))[:rows].to(dev),
        "A_log": rand(hv, scale=0.5), "dt_bias": rand(hv, scale=0.5), "norm_weight": 1 + rand(dv, scale=0.2)}
    return inputs, {"num_k_heads": hk, "head_k_dim": dk, "num_v_heads": hv, "head_v_dim": dv, "eps": 1e-6}


def state_bytes(hk, hv, dk, dv, width, rows):
    channels = 2 * hk * dk + hv * dv
    return rows * (2 * hv * dk * dv * 4 + 2 * (width - 1) * channels * 2)


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    import triton
    import triton.testing as tt

    from flashnext.ops import gdn_decode_triton as kernels
    from flashnext.ops.gdn_decode import gdn_decode_reference

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    header = (f"{'model':11} {'B':>2} {'out err':>8} {'S err':>8} {'conv':>5} {'eager us':>9} {'graph us':>9} "
              f"{'GB/s':>6} {'%ceil':>6} {'best us':>8} {'warps':>5} {'best GB/s':>9} {'ref us':>8}")
    print(header)
    print("-" * len(header))
    failures = 0
    for name, hk, hv, dk, dv, width, activation in MODELS:
        for rows in BATCHES:
            inputs, kw = make_problem(hk, hv, dk, dv, width, rows, gen, dev)
            kw["activation"] = activation
            try:
                ref_states = {n: inputs[n].clone() for n in ("conv_state", "ssm_state")}
                want = gdn_decode_reference(**{**inputs, **ref_states}, **kw)
                got = kernels.gdn_decode_triton(**inputs, **kw)
                out_err = rel_err(got, want)
                s_err = rel_err(inputs["ssm_state"], ref_states["ssm_state"])
                conv_ok = torch.equal(inputs["conv_state"], ref_states["conv_state"])
                ok = out_err < 2e-2 and s_err < 2e-2 and conv_ok
                failures += not ok

                def step(warps=None, inputs=inputs, kw=kw):
                    return kernels.gdn_decode_triton(**inputs, **kw, num_warps=warps)

                eager = tt.do_bench(step, warmup=25, rep=100)
                graph = tt.do_bench_cudagraph(step, rep=100)
                sweep = {w: tt.do_bench_cudagraph(lambda w=w: step(w), rep=50) for w in WARPS}
                best_warps = min(sweep, key=sweep.get)
                ref = tt.do_bench(lambda inputs=inputs, kw=kw: gdn_decode_reference(**inputs, **kw), warmup=5, rep=50)
            except Exception as error:  # noqa: BLE001 - one broken shape must not hide the others
                failures += 1
                print(f"{name:11} {rows:2d}  FAILED: {type(error).__name__}: {error}")
                continue
            nbytes = state_bytes(hk, hv, dk, dv, width, rows)
            gbs = nbytes / (graph * 1e-3) / 1e9
            best_gbs = nbytes / (sweep[best_warps] * 1e-3) / 1e9
            print(f"{name:11} {rows:2d} {out_err:8.1e} {s_err:8.1e} {'ok' if conv_ok else 'DIFF':>5}"
                  f"{'' if ok else '!'} {eager * 1e3:9.1f} {graph * 1e3:9.1f} {gbs:6.0f} "
                  f"{100 * gbs * 1e9 / COPY_CEILING:5.1f}% {sweep[best_warps] * 1e3:8.1f} {best_warps:5d} "
                  f"{best_gbs:9.0f} {ref * 1e3:8.1f}")
    print(f"\n{'ALL CORRECT' if not failures else f'{failures} FAILURE(S)'} (err = max|triton - reference| / "
          "max|reference|, bound 2e-2 (a few bf16 ulps) for the output and the fp32 state; conv tail must be equal). "
          f"Default warps of the delta-rule kernel: {kernels.default_num_warps(128, 128)}.")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
