"""QSA selection as token lists: block scores → the tokens each query attends to (the indexer's decode, and its
prefill for long prompts).

scores [N, blocks] fp32 (Σ_heads relu(q·key)/√D, −inf for blocks not complete before the query;
ops/qsa_scores.py); pos [N] (each query's position); k top blocks (≤ blocks); ratio tokens a block; limit (a valid
position, > every entry written) → token_index [N, k·ratio + ratio − 1] int64, token_valid [N, same] bool:
- the k blocks of highest score, in ascending block order, each as its `ratio` tokens; valid where the block is
  complete before the query (with fewer than k complete blocks some chosen ones are not);
- then the ratio − 1 tail tokens of the query's incomplete block, valid up to the query's position (clamped below
  `limit`, so an invalid one still indexes memory that exists).

Which blocks tie-break: among equal scores at the k-th place the lower block index wins (−0.0 counts as 0.0). The
order of the list is fixed (ascending) rather than by score, so the attention over it sums in one order whatever
selected it — the reference's sort on the GPU or the CPU, or the kernel.

`qsa_token_lists_reference` is that definition in torch (a stable sort); `qsa_token_lists` sends CUDA tensors to the
Triton kernels (ops/qsa_token_lists_triton.py: a program a row finds the k-th score and writes the lists; rows past
16,384 blocks take a first launch over slices), which replace torch.topk — 84 µs a call for 512 of 16,384 blocks at
64K context on the H200, plus a 20 µs sort of the result — and the ~20 small kernels that built the lists; sizes the
kernels cannot select (`fits`: past ~524K blocks at k = 512) take the reference. FLASHNEXT_QSA_LISTS=reference
forces the reference.
"""
from __future__ import annotations

import os

import torch


def qsa_top_blocks_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k blocks of highest score in each row [N, k], ascending, ties at the k-th score to the lower block (the
    selection of the lists below)."""
    by_score = torch.sort(scores + 0.0, dim=-1, descending=True, stable=True).indices[:, :k]
    return by_score.sort(dim=-1).values


def _kernels_take(scores: torch.Tensor, k: int) -> bool:
    if not scores.is_cuda or os.environ.get("FLASHNEXT_QSA_LISTS", "triton") == "reference":
        return False
    from flashnext.ops.qsa_token_lists_triton import fits

    return fits(scores.shape[1], k)


def qsa_top_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """See qsa_top_blocks_reference (the indexer's mask path for short prompts selects what its lists would). CUDA:
    the list kernel with one token a block, whose token list is then the block list (two sorts otherwise)."""
    if not _kernels_take(scores, k):
        return qsa_top_blocks_reference(scores, k)
    from flashnext.ops.qsa_token_lists_triton import qsa_token_lists_triton

    rows, n = scores.shape
    last = torch.full((rows,), n - 1, dtype=torch.long, device=scores.device)
    return qsa_token_lists_triton(scores, last, k, 1, n)[0]


def qsa_token_lists_reference(scores: torch.Tensor, pos: torch.Tensor, k: int, ratio: int,
                              limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = qsa_top_blocks_reference(scores, k)
    complete_before = (pos + 1) // ratio
    within = torch.arange(ratio, device=scores.device)
    chosen = (top[:, :, None] * ratio + within).flatten(1)
    chosen_valid = (top < complete_before[:, None])[:, :, None].expand(-1, -1, ratio).flatten(1)
    tail = complete_before[:, None] * ratio + within[None, : ratio - 1]
    token_index = torch.cat([chosen, tail.clamp(max=limit - 1)], dim=1)
    token_valid = torch.cat([chosen_valid, tail <= pos[:, None]], dim=1)
    return token_index, token_valid


def qsa_token_lists(scores: torch.Tensor, pos: torch.Tensor, k: int, ratio: int,
                    limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    assert 0 < k <= scores.shape[1], "k blocks of the scored ones"
    if not _kernels_take(scores, k):
        return qsa_token_lists_reference(scores, pos, k, ratio, limit)
    from flashnext.ops.qsa_token_lists_triton import qsa_token_lists_triton

    return qsa_token_lists_triton(scores, pos.contiguous(), k, ratio, limit)


def compile_for_lengths(device: torch.device, k: int, ratio: int, max_blocks: int, max_mask_blocks: int) -> None:
    """Run the list kernels once in every class of block count a request can meet — each power of two above k (fewer
    blocks than k are all chosen: the callers take dense attention) up to `max_blocks` as token lists (`ratio` tokens
    a block), and up to `max_mask_blocks` (the indexer's mask path, short prompts) as block lists (qsa_top_blocks) —
    so that none compiles on a request's way: the kernels take their tile (CHUNK, and past it the slices' size) from
    the count's power of two. On the H200 (scripts/gpu_compiles.py, session 17) agent turns of 233 and 568 new tokens
    after the server's warm-up each added a variant of the list kernel (compiled, or loaded from Triton's cache) and
    waited 0.74 / 0.83 s for their first token, against 0.27 s for 727 new tokens. A no-op off CUDA (the reference
    runs there)."""
    if torch.device(device).type != "cuda":
        return
    from flashnext.ops.qsa_token_lists_triton import CHUNK, MANY_ROWS, fits

    n = 1 << k.bit_length()          # the power of two that holds k + 1 blocks
    while fits(n, k) and n // 2 < max_blocks:
        # a prefill's blocks of queries may take more warps than a decode step's rows (the kernels' _warps)
        for rows in (1, MANY_ROWS) if n <= CHUNK else (1,):
            scores = torch.randn(rows, n, device=device)
            last = torch.full((rows,), n * ratio - 1, dtype=torch.long, device=device)
            qsa_token_lists(scores, last, k, ratio, n * ratio)
        if n // 2 < max_mask_blocks:
            qsa_top_blocks(scores, k)
        n *= 2
