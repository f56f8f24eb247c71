"""A decode step in fixed-shape tensors: one new token for each of B sequences.

`ForwardContext` describes any step with Python lists (segments of any length); a decode step that a CUDA
graph replays needs its inputs in tensors whose shapes never change, read on the device with no host sync.
That is this: per row the new token, its position (= tokens of the sequence already computed), the
recurrent-state slot, and the KV block table padded to a fixed width W. Rows past the real batch point at
a scratch slot and a scratch block (flashnext/engine/cuda_graph.py), so their writes land where nobody reads.
Layers implement `decode(x, …, batch)` beside `forward`: the same math as a one-token segment, tested equal.

A `chained` batch is B consecutive tokens of one sequence instead (one slot, positions p … p+B−1): a short prompt
chunk of a sequence under way, captured too (DecodeGraphs.extend). Attention and the MoE treat its rows like any
others (each row attends up to its own position, the KV of all rows written first); the layers whose state moves
token by token run its rows as one sequence's: GatedDeltaNet and PLE as a prefill segment, the QSA indexer's key
append as the rows appended one after another (ops/qsa_key_append.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class DecodeBatch:
    input_ids: torch.Tensor     # [B] int64
    positions: torch.Tensor     # [B] int64: position of the new token
    slots: torch.Tensor         # [B] int64: StatePool slot of each row
    block_table: torch.Tensor   # [B, W] int64: KV blocks of each row, padded
    kv: "KVPool"                # noqa: F821 - flashnext.cache.kv_pool
    states: "StatePool"         # noqa: F821 - flashnext.cache.state_pool
    chained: bool = False       # the rows are one sequence's consecutive tokens (see the module's docstring)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        """Tokens each row's attention sees, the new one included."""
        return self.positions + 1

    @cached_property
    def token_rows(self) -> torch.Tensor:
        """Flat KV row of each row's new token: computed once per step, used by every attention layer."""
        return self.page_rows(self.positions, self.kv.block_size)

    def chain_state(self, pool: torch.Tensor) -> torch.Tensor:
        """A chained batch's slot of a per-slot state tensor [slots, …] (a copy: read by device index, no sync)."""
        return pool.index_select(0, self.slots[:1])[0]

    def set_chain_state(self, pool: torch.Tensor, value: torch.Tensor) -> None:
        """Write a chained batch's slot of `pool` back (by device index)."""
        pool.index_copy_(0, self.slots[:1], value[None].to(pool.dtype))

    def page_rows(self, index: torch.Tensor, per_page: int) -> torch.Tensor:
        """Flat row ids of per-sequence item `index` [B, ...] in a paged [blocks, per_page, ...] tensor (KV
        tokens with per_page = block_size, pooled indexer keys with block_size / compress_ratio)."""
        page = torch.gather(self.block_table, 1, (index // per_page).reshape(self.size, -1)).view_as(index)
        return page * per_page + index % per_page

    @classmethod
    def from_lists(cls, input_ids, positions, slots, block_tables, kv, states, width: int | None = None) -> DecodeBatch:
        """Eager construction (tests, CPU): block tables padded with their first block to `width`."""
        width = width or max(len(t) for t in block_tables)
        table = [list(t) + [t[0]] * (width - len(t)) for t in block_tables]
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=kv.device)  # noqa: E731
        return cls(as_long(input_ids), as_long(positions), as_long(slots), as_long(table), kv, states)
