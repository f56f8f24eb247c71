"""What one forward step computes: which sequences, which of their tokens, and where their state lives.

Models stay functions of (tokens, this context): the engine owns the pools and says, per sequence, its
recurrent-state slot, its KV block table and how many of its tokens are already computed. Tokens of all
segments are concatenated in one flat batch, segment after segment.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Segment:
    slot: int                  # recurrent-state slot in the StatePool
    blocks: torch.Tensor       # int64 KV block ids of the sequence, in order, covering context_len + length
    start: int                 # first row of this segment in the flat batch
    length: int                # tokens computed in this step
    context_len: int           # tokens of this sequence computed in earlier steps

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def total_len(self) -> int:
        return self.context_len + self.length


@dataclass
class ForwardContext:
    segments: list[Segment]
    kv: "KVPool"               # noqa: F821 - flashnext.cache.kv_pool
    states: "StatePool"        # noqa: F821 - flashnext.cache.state_pool
    # A RowPlan (engine/row_graphs.py): the step's row-wise calls replay CUDA graphs over rows padded to its bucket
    pieces: "RowPlan | None" = None   # noqa: F821 - flashnext.engine.row_graphs
    positions: torch.Tensor = field(init=False)

    def __post_init__(self):
        # written once, page-locked on a GPU: a pageable copy waits for every step queued (weights/pinned.staged)
        positions = torch.empty(self.num_tokens, dtype=torch.long, pin_memory=self.kv.device.type == "cuda")
        if self.segments:
            torch.cat([torch.arange(s.context_len, s.total_len) for s in self.segments], out=positions)
        self.positions = positions.to(self.kv.device, non_blocking=True)

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    def rows(self, site: str, fn, *args):
        """`fn(*args)`: row-wise work (every tensor argument and output has the tokens on dim 0, each output row a
        function of the same rows only, no host sync) — replayed from a CUDA graph when the step has `pieces`, its
        tensors then padded to the plan's bucket (rows past the step's tokens are zeros or whatever they make).
        `site` names the call in the model: one name per place, the same in every layer."""
        return fn(*args) if self.pieces is None else self.pieces.call(site, fn, args)

    def sequence(self, site: str, fn, *args):
        """`fn(*args, where)` when the step replays a plan of one sequence's rows (where = [its state slot, its rows] on
        the device, the tensors padded to the plan's bucket): token mixing captured with the row-wise work, which must
        leave the sequence's states as the real rows alone would. None otherwise: the caller mixes eagerly."""
        if self.pieces is None or not self.pieces.single:
            return None
        return self.pieces.call(site, fn, (*args, self.pieces.where))
