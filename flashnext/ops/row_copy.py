"""Copy rows between many pairs of tables in one launch: `destinations[t][d] = sources[t][s]` for each (t, s, d).

    sources       list of tables [R_t, ...], contiguous (on the GPU path: page-locked host memory or device memory)
    destinations  list of tables [S_t, ...], contiguous, each with its source's row shape and dtype
    tables, source_rows, destination_rows  [n] int64 on the host: which pair, which rows

`copy_table_rows` is the reference (a torch copy a row). `RowCopier` is the fast path for the expert pools'
copies on the eager path (cache/expert_cache.py: misses and prefetches, ~5 tensors an expert). As torch copies
they were one cudaMemcpyAsync each, ~25 µs of host time apiece on the H200 (session 12: 20.9 ms of host time a
token for the 810 copies a token that pools then made between captured decode steps, the GPU waiting). The copier
computes every row's source and destination address on the host in a few tensor ops, uploads the [3, n·tensors]
plan once, and a kernel copies all rows: sources in page-locked host memory are read over PCIe through unified
virtual addressing, as the MoE kernels read missing experts (ops/moe_int4_decode_triton.py).

Rows are moved as 8-byte words: every row's size and every table's address must be a multiple of 8 bytes.
`table_row_copy` picks: the kernel on CUDA where the tables allow it, else the reference (and with
FLASHNEXT_ROW_COPY=reference, to bisect a wrong answer on the GPU).
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from flashnext.ops.device import num_sms
from flashnext.weights.pinned import device_address, upload

WORD = 8              # bytes a lane moves at a time
BLOCK = 1024          # words a program moves per loop step


def copy_table_rows(sources: list[torch.Tensor], destinations: list[torch.Tensor], tables: torch.Tensor,
                    source_rows: torch.Tensor, destination_rows: torch.Tensor) -> None:
    """The specification: one row copy at a time."""
    for t, s, d in zip(tables.tolist(), source_rows.tolist(), destination_rows.tolist()):
        destinations[t][d].copy_(sources[t][s])


def table_row_copy(sources: list[torch.Tensor], destinations: list[torch.Tensor]
                   ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """copy_table_rows over these tables: → a function of (tables, source_rows, destination_rows)."""
    if (destinations[0].is_cuda and os.environ.get("FLASHNEXT_ROW_COPY", "triton") != "reference"
            and words_fit(sources + destinations)):
        return RowCopier(sources, destinations).copy
    return functools.partial(copy_table_rows, sources, destinations)


def words_fit(tables: list[torch.Tensor]) -> bool:
    """Whether every table starts at, and has rows of, whole words (what the kernel moves)."""
    return all(t.data_ptr() % WORD == 0 and _row_bytes(t) % WORD == 0 for t in tables)


def _row_bytes(table: torch.Tensor) -> int:
    return math.prod(table.shape[1:]) * table.element_size()   # an empty table too


@triton.jit(do_not_specialize=["n"])
def _copy_rows_kernel(plan_ptr, n, BLOCK: tl.constexpr):
    """plan [3, n]: source address, destination address, words. Programs (i, p) of P move row i's words
    p·BLOCK, (p + P)·BLOCK, …"""
    i = tl.program_id(0)
    part, parts = tl.program_id(1), tl.num_programs(1)
    src = tl.load(plan_ptr + i).to(tl.pointer_type(tl.int64))
    dst = tl.load(plan_ptr + n + i).to(tl.pointer_type(tl.int64))
    words = tl.load(plan_ptr + 2 * n + i)
    offs = tl.arange(0, BLOCK)
    for start in range(part * BLOCK, words, parts * BLOCK):
        at = start + offs
        ok = at < words
        tl.store(dst + at, tl.load(src + at, mask=ok), mask=ok)


class RowCopier:
    """copy_table_rows in one launch on the current stream, for fixed lists of tables (their addresses are read
    once: the tables must stay where they are)."""

    def __init__(self, sources: list[torch.Tensor], destinations: list[torch.Tensor]):
        assert len(sources) == len(destinations) and sources
        self.device = destinations[0].device
        row_bytes = []
        for src, dst in zip(sources, destinations):
            assert src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
            assert src.shape[1:] == dst.shape[1:], "a source and its destination differ in row shape"
            row_bytes.append(_row_bytes(src))
        self.row_bytes = torch.tensor(row_bytes, dtype=torch.long)
        self.source_base = torch.tensor([device_address(t, self.device) for t in sources], dtype=torch.long)
        self.destination_base = torch.tensor([device_address(t, self.device) for t in destinations], dtype=torch.long)
        if not words_fit(sources + destinations):
            raise ValueError(f"rows and tables must be multiples of {WORD} bytes to be copied as words")

    def copy(self, tables: torch.Tensor, source_rows: torch.Tensor, destination_rows: torch.Tensor) -> None:
        n = len(tables)
        if not n:
            return
        row_bytes = self.row_bytes[tables]
        plan = torch.stack([self.source_base[tables] + source_rows * row_bytes,
                            self.destination_base[tables] + destination_rows * row_bytes, row_bytes // WORD])
        plan = upload(torch.empty(plan.shape, dtype=plan.dtype, device=self.device), plan)
        # enough programs to keep a few hundred loads in flight over PCIe, whatever the number of rows
        parts = max(1, min(64, triton.cdiv(2 * num_sms(self.device), n)))
        _copy_rows_kernel[(n, parts)](plan, n, BLOCK=BLOCK)
