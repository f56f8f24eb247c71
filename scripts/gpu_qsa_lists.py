"""On the GPU machine: the QSA token-list kernel (ops/qsa_token_lists_triton.py) equals its reference bit for bit at
the indexer's real sizes (Flash-Next: 512 of the context's blocks, 4 tokens a block), with ties and −inf, and what
a call costs in a CUDA graph against the torch path it replaced (topk, then ~20 small kernels), and at 2 to 32
warps a program (the kernel's _warps).
Run: python3 scripts/gpu_qsa_lists.py"""
import sys

import torch

import flashnext.ops.qsa_token_lists_triton as kernel
from flashnext.ops.qsa_token_lists import qsa_token_lists_reference
from flashnext.ops.qsa_token_lists_triton import qsa_token_lists_triton

K, RATIO = 512, 4


def torch_lists(scores, pos, k, r, limit):
    """The indexer's lists before the kernel, kept as they were for the comparison (torch.topk and glue; its order by
    score, not by block)."""
    complete_before = (pos + 1) // r
    top = scores.topk(k, dim=-1).indices
    chosen_valid = top < complete_before[:, None]
    within = torch.arange(r, device=pos.device)
    chosen = (top[:, :, None] * r + within).flatten(1)
    tail = complete_before[:, None] * r + within[None, : r - 1]
    token_index = torch.cat([chosen, tail.clamp(max=limit - 1)], dim=1)
    token_valid = torch.cat([chosen_valid[:, :, None].expand(-1, -1, r).flatten(1), tail <= pos[:, None]], dim=1)
    return token_index, token_valid


def graph_us(fn):
    """µs a call, replayed in a CUDA graph (triton.testing)."""
    import triton.testing as tt

    return tt.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def main() -> int:
    ok = True
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'rows':>4} {'blocks':>6} {'ties':>5} {'equal':>5} {'kernel µs':>9} {'torch µs':>8}")
    for rows, blocks in [(1, 2500), (1, 16384), (1, 16389), (1, 65536), (8, 16384), (3, 40001), (64, 4000)]:
        for ties in (False, True):
            if ties:
                scores = torch.randint(0, 6, (rows, blocks), device="cuda", generator=g).float()
                scores[torch.rand(rows, blocks, device="cuda", generator=g) < 0.1] = -0.0
            else:
                scores = torch.rand(rows, blocks, device="cuda", generator=g) * 5
            pos = torch.full((rows,), blocks * RATIO + 1, device="cuda", dtype=torch.int64)
            pos[0] = min(pos[0], 300 * RATIO)      # a row with fewer complete blocks than K
            complete_before = (pos + 1) // RATIO
            scores[torch.arange(blocks, device="cuda")[None, :] >= complete_before[:, None]] = float("-inf")
            limit = blocks * RATIO
            want = qsa_token_lists_reference(scores, pos, K, RATIO, limit)
            got = qsa_token_lists_triton(scores, pos, K, RATIO, limit)
            same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            ok &= same
            now = graph_us(lambda: qsa_token_lists_triton(scores, pos, K, RATIO, limit))
            before = graph_us(lambda: torch_lists(scores, pos, K, RATIO, limit))
            print(f"{rows:4} {blocks:6} {ties!s:>5} {same!s:>5} {now:9.1f} {before:8.1f}")
    # the mask path of prompts up to 16K (QSAIndexer.forward): a query block's top blocks through the kernel
    from flashnext.ops.qsa_token_lists import qsa_top_blocks, qsa_top_blocks_reference

    scores = torch.rand(1024, 2500, device="cuda", generator=g) * 5
    same = torch.equal(qsa_top_blocks(scores, K), qsa_top_blocks_reference(scores, K))
    ok &= same
    print(f"top blocks of 1,024 queries x 2,500 blocks: equal {same}, kernel "
          f"{graph_us(lambda: qsa_top_blocks(scores, K)):.1f} µs, two sorts "
          f"{graph_us(lambda: qsa_top_blocks_reference(scores, K)):.1f} µs")
    print("warps a program (kernel._warps) against µs a call (a prefill's query blocks of 1,024 rows at 30K / 40K / "
          "64K / 160K tokens of context, then decode's single rows):")
    default = kernel._warps
    for rows, blocks in [(1024, 7500), (1024, 10000), (1024, 16384), (1024, 40000), (1, 2500), (1, 16384),
                         (1, 65536)]:
        scores = torch.rand(rows, blocks, device="cuda", generator=g) * 5
        pos = torch.full((rows,), blocks * RATIO + 1, device="cuda", dtype=torch.int64)
        times = {}
        for warps in (2, 4, 8, 16, 32):
            kernel._warps = lambda size, rows=1, w=warps: w
            times[warps] = graph_us(lambda: qsa_token_lists_triton(scores, pos, K, RATIO, blocks * RATIO))
        kernel._warps = default
        print(f"  {rows} x {blocks}: " + ", ".join(f"{w} warps {t:.1f}" for w, t in times.items()))
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
