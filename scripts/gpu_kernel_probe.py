"""On the GPU machine: what limits the decode step's heaviest kernels (BENCHMARKS.md: the INT4 GEMVs, the MoE
decode kernels and the hyper-connection mix each run at ~25% of the copy bandwidth).

    python3 scripts/gpu_kernel_probe.py             # the read ceiling: µs to stream the step's weight sizes
    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
        --section LaunchStats --section ComputeWorkloadAnalysis --section InstructionStats \
        -k regex:'gate_up|_down_kernel|_hc_|int4|Int4' python3 scripts/gpu_kernel_probe.py --kernels

Read ceiling: a Triton kernel that only reads int32 words and sums them (no dequantisation, no reduction across
programs), launched back to back in one CUDA graph over a rotation of buffers larger than the 50 MB L2 (each
launch reads from HBM), at the sizes the decode step reads per kernel. It is what any kernel of that size can
hope for on this GPU with Triton: if it is near 4.27 TB/s, the GEMVs lose their time in their own instructions;
if it is far, in launch, ramp and tail.
--kernels: each heavy decode kernel at Flash-Next's shapes (M = 1; the MoE kernels with the shared expert as their
eleventh slot, as the decode step runs them since 8beacfa), twice, for a profiler to read.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

COPY_CEILING = 4.27e12
L2_BYTES = 50 << 20
# (what, bytes): per-launch weight bytes of the decode step's kernels (INT4 with g128 scales, or bf16)
SIZES = [("shared down [2560x640] int4", 0.86e6), ("gdn out [2560x6144] int4", 8.1e6),
         ("hc down/up [320x10240] bf16", 6.55e6), ("moe down 10x[2560x640] int4", 8.6e6),
         ("attn q|k|v [13312x2560] int4", 17.6e6), ("moe gate_up 10x[1280x2560] int4", 17.2e6),
         ("gdn qkv|z [16384x2560] int4", 21.6e6)]


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    start = pid * per_program
    for off in range(start, tl.minimum(start + per_program, n_words), BLOCK):
        offs = off + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def buffers(n_bytes: float) -> list[torch.Tensor]:
    """Copies of an n_bytes buffer that together are 3× the L2: a rotation through them reads from HBM."""
    copies = max(4, -(-3 * L2_BYTES // int(n_bytes)))
    return [torch.ones(int(n_bytes) // 4, dtype=torch.int32, device="cuda") for _ in range(copies)]


def read_us(bufs: list[torch.Tensor], programs: int, block: int, warps: int) -> float:
    """µs per launch of a read of one buffer, in one CUDA graph over the rotation `bufs` (gpu_w4a16.cold_us)."""
    from gpu_w4a16 import cold_us

    n_words = bufs[0].numel()
    out = torch.empty(programs * block, dtype=torch.int32, device="cuda")
    per = triton.cdiv(triton.cdiv(n_words, programs), block) * block
    return cold_us(lambda b: _read_kernel[(programs,)](b, out, n_words, per, BLOCK=block, num_warps=warps), bufs)[0]


def ceiling_table() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs: read ceiling (best of programs × block × warps)")
    print(f"{'kernel size':34} {'MB':>6} {'best us':>8} {'TB/s':>6} {'%copy':>6}  config          "
          f"{'1 prog/SM':>9}")
    for what, size in SIZES:
        bufs = buffers(size)
        results = [(read_us(bufs, per_sm * sms, block, warps), per_sm, block, warps)
                   for per_sm in (1, 2, 4, 8) for block in (1024, 4096) for warps in (4, 8)]
        del bufs
        best = min(results)
        one = min(r[0] for r in results if r[1] == 1)
        print(f"{what:34} {size / 1e6:6.2f} {best[0]:8.2f} {size / best[0] / 1e6:6.2f} "
              f"{100 * size / best[0] / 1e6 / (COPY_CEILING / 1e12):5.1f}%  {best[1]}/SM b{best[2]} w{best[3]:<4}"
              f"{one:9.2f}")


def run_kernels() -> None:
    """Each heavy decode kernel twice at Flash-Next's M = 1 shapes (the profiler reads the second)."""
    from flashnext.ops.hyper_connection_triton import hc_mix_triton
    from flashnext.ops.moe_int4 import SharedExpert
    from flashnext.ops.moe_int4_decode_triton import moe_int4_decode
    from flashnext.ops.w4a16_tinygemm import tinygemm_matmul, to_tinygemm
    from flashnext.weights.int4_layout import Int4Weight, quantize_rtn

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    experts, top_k, hidden, inter = 512, 10, 2560, 640
    x = torch.randn(1, hidden, generator=gen, device=dev).bfloat16()

    def random_experts(n, k):   # E experts of [K/8, N] words, zero-mean scales (as scripts/gpu_moe.py)
        words = torch.randint(-2**31, 2**31 - 1, (experts, k // 8, n), generator=gen, device=dev, dtype=torch.int32)
        scales = (torch.randn(experts, k // 128, n, generator=gen, device=dev) / (4.6 * k ** 0.5)).bfloat16()
        return Int4Weight(words, scales, None, None, 128)

    w_gate_up, w_down = random_experts(2 * inter, hidden), random_experts(hidden, inter)
    ids = torch.randperm(experts, generator=gen, device=dev)[:top_k].reshape(1, top_k)
    weights = torch.full((1, top_k), 1 / top_k, device=dev, dtype=torch.bfloat16)
    qkvz = to_tinygemm(quantize_rtn(torch.randn(16384, hidden, generator=gen, device=dev) / hidden ** 0.5, 128))
    width, lowrank, hc = 4 * hidden, 320, 4
    h = torch.randn(1, width, generator=gen, device=dev).bfloat16()
    norm_w = (torch.randn(width, generator=gen, device=dev) * 0.2).bfloat16()
    w_down_hc = (torch.randn(lowrank, width, generator=gen, device=dev) / width ** 0.5).bfloat16()
    w_up_hc = (torch.randn(width, lowrank, generator=gen, device=dev) / lowrank ** 0.5).bfloat16()
    w_inj = (torch.randn(hc, width, generator=gen, device=dev) / width ** 0.5).bfloat16()
    # the shared expert rides along as slot k, as SparseMoe.decode runs it (ops.moe_int4.SharedExpert)
    one = lambda w: Int4Weight(w.qweight[0], w.scales[0], None, None, 128)   # noqa: E731
    shared = SharedExpert(one(w_gate_up), one(w_down), torch.zeros(1, 1, device=dev, dtype=torch.bfloat16))
    for _ in range(2):
        moe_int4_decode(x, ids, weights, w_gate_up, w_down, shared=shared)
        tinygemm_matmul(x, qkvz)
        hc_mix_triton(h, norm_w, w_down_hc, w_up_hc, w_inj, hc, hidden, 1e-6)
    torch.cuda.synchronize()
    print("ran: moe_int4_decode, tinygemm qkv|z, hc_mix_triton (x2 each)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", action="store_true", help="run the heavy decode kernels for a profiler")
    args = parser.parse_args()
    run_kernels() if args.kernels else ceiling_table()


if __name__ == "__main__":
    main()
