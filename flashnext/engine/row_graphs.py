"""Prefill steps whose row-wise work replays CUDA graphs: piecewise capture around the sequence mixers.

An eager prefill step of a short chunk is host-bound: Flash-Next INT4 launches ~5,300 kernels for 256 tokens (H200,
session 20: 0.18–0.31 s to the first token while the GPU was busy 57 ms). Most of those kernels are row-wise — each
output row a function of the same input rows only (projections, norms, hyper-connection mixes, the MoE) — and so
can be captured once for a padded number of rows and replayed for any chunk that fits. What mixes rows (the
GatedDeltaNet conv and delta rule, attention over the cache, the QSA indexer, PLE) depends on each sequence's
length and context and stays eager, on the real rows (ForwardContext.segments), between the replays — vLLM's
"piecewise" CUDA graphs.

A model marks its row-wise calls with `ctx.rows(site, fn, *args)` (models/context.py): eagerly that is
`fn(*args)`; with a RowPlan in the context it is one graph per call. The tensors passed between calls live in
static buffers keyed by (site, output index), shared by every layer's call of a site and by every bucket (one plan
runs at a time, and a site's output is read before the next layer's call of the same site overwrites it — checked
while capturing). A call's other tensor arguments (what the eager code between computed: a mixer's output, the
token ids) are copied into static input buffers before its replay, their rows past the chunk's zeroed, so padding
rows stay finite. Buckets are rows padded up (bucket_rows); the first pass of a bucket captures (each call run once eagerly
first, which compiles its kernels and gives the pass its outputs: a call runs once a pass), later passes replay.
Rules for a site's fn: every tensor argument and output has the tokens on dim 0 (the output's rows as many as the
input's), no host sync, no state beyond its outputs (a sequence's call, below, moves its own states on).

A step of one sequence also captures what of its token mixing takes a slot and a length on the device
(`ctx.sequence`: GatedDeltaNet's conv and delta rule, its padding rows made to leave the states as they are), so
such plans are kept apart from those of several sequences, which run all token mixing eagerly.

On a CPU nothing is captured: a "graph" is the call's body recorded and run again at each replay, on the same
padded buffers in the same order, which is how the tests cover the padding, the buffers' sharing, the copies and
what a capture pass runs without a GPU.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from flashnext.weights.pinned import staged

log = logging.getLogger("flashnext.engine")

# The fewest rows a bucket pads to: a chunk of a few tokens costs what 64 do on the GPU (the weights are read
# whatever the rows) while its host time is the same as any other chunk's.
MIN_BUCKET = 64
# Past it buckets step by this many rows instead of doubling: a step of thousands of rows is GPU-bound, and padding
# 2,100 rows to 4,096 would nearly double its work.
LARGE_STEP = 512


def bucket_rows(rows: int) -> int:
    """The rows a step of `rows` pads to: a power of two from MIN_BUCKET to LARGE_STEP · 2, then multiples of
    LARGE_STEP."""
    if rows > 2 * LARGE_STEP:
        return -(-rows // LARGE_STEP) * LARGE_STEP
    return max(MIN_BUCKET, 1 << max(0, rows - 1).bit_length())


def buckets_up_to(rows: int) -> list[int]:
    sizes, size = [], MIN_BUCKET
    while size <= bucket_rows(rows):
        sizes.append(size)
        size = bucket_rows(size + 1)
    return sizes


class _Uncaptured:
    """A CPU's stand-in for a captured graph: capturing records the body without running it, and each replay runs it
    again on the same static buffers — the order of work a GPU's capture pass and replays have."""

    def __init__(self, body):
        self.body = body

    def replay(self) -> None:
        self.body()

    def reset(self) -> None:
        self.body = None


@dataclass
class _Call:
    """One captured call: its site, what each argument is, its graph and its outputs."""
    site: str
    args: list                          # per argument: ("shared", tensor) | ("input", buffer) | ("value", v)
    graph: torch.cuda.CUDAGraph | _Uncaptured
    outputs: object                     # the structure handed back: views of the output buffers (or None entries)


def _flatten(out) -> tuple[list, bool]:
    """A fn's result → (its entries, whether it was a tuple): a tensor or a tuple of tensors and Nones."""
    return (list(out), True) if isinstance(out, tuple) else ([out], False)


class RowPlan:
    """The row-wise calls of one bucket's prefill forward, in the order the model makes them. A plan for steps of
    one sequence (`single`) may also hold that sequence's calls (ForwardContext.sequence): they read its slot and
    length from `where`, a static [slot, rows] on the device."""

    def __init__(self, owner: RowGraphs, bucket: int, single: bool):
        self.owner = owner
        self.bucket = bucket
        self.single = single
        self.calls: list[_Call] = []
        self.captured = False
        self.rows = 0
        self._next = 0
        self._writer: dict[tuple[str, int], int] = {}    # buffer key → the call that last wrote it (capture pass)
        self._made_by: dict[int, tuple[tuple[str, int], int]] = {}   # id(output view) → (its key, its call)
        self.where = torch.zeros(2, dtype=torch.long, device=owner.device) if single else None

    def begin(self, rows: int, slot: int | None = None) -> RowPlan:
        if not 0 < rows <= self.bucket:
            raise ValueError(f"{rows} rows do not fit the {self.bucket}-row bucket")
        if (slot is not None) != self.single:
            raise ValueError("a plan for one sequence's steps takes its slot, any other plan none")
        self.rows, self._next = rows, 0
        if self.single:   # queued, not waited for
            self.where.copy_(staged([slot, rows], self.where.device), non_blocking=True)
            self._writer[("where", 0)] = -1
            self._made_by[id(self.where)] = (("where", 0), -1)
        return self

    def end(self) -> None:
        """After the forward: the first pass is now the plan; a later pass must have made every call of it."""
        if self.captured and self._next != len(self.calls):
            raise RuntimeError(f"a prefill pass made {self._next} row-wise calls, its plan {len(self.calls)}")
        self.captured = True
        self._writer.clear()

    def call(self, site: str, fn, args: tuple):
        if not self.owner.enabled:   # a capture failed earlier in this pass: the rest runs eagerly
            return fn(*args)
        if self.captured:
            return self._replay(site, args)
        return self._capture(site, fn, args)

    # ---- later passes ----
    def _replay(self, site: str, args: tuple):
        call = self.calls[self._next]
        if call.site != site or len(call.args) != len(args):
            raise RuntimeError(f"row-wise call {self._next} is {site}, its plan's {call.site}")
        self._next += 1
        for (kind, held), arg in zip(call.args, args):
            if kind == "input":
                self._fill(held, arg)
            elif kind == "shared" and arg is not held:
                raise RuntimeError(f"{site}: an argument the plan took from an earlier call is another tensor now")
            elif kind == "value" and arg != held:
                raise RuntimeError(f"{site}: argument {arg!r} differs from the plan's {held!r}")
        call.graph.replay()
        return call.outputs

    # ---- the first pass ----
    def _capture(self, site: str, fn, args: tuple):
        index = len(self.calls)
        kinds, inputs = [], []
        for j, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor):
                kinds.append(("value", arg))
                inputs.append(arg)
            elif id(arg) in self._made_by:
                key, writer = self._made_by[id(arg)]
                if self._writer[key] != writer:
                    raise RuntimeError(f"{site} reads the output of call {writer} ({key[0]}) after call "
                                       f"{self._writer[key]} overwrote its buffer")
                kinds.append(("shared", arg))
                inputs.append(arg)
            else:
                buffer = self.owner.buffer(("in", site, j), arg, self.bucket)
                self._fill(buffer, arg)
                kinds.append(("input", buffer))
                inputs.append(buffer)
        warm, is_tuple = _flatten(fn(*inputs))   # eagerly once: compiles the kernels before the capture
        flat = [None if t is None else self.owner.buffer((site, i), t, self.bucket) for i, t in enumerate(warm)]
        for t, buffer in zip(warm, flat):
            if t is not None and t.shape[0] != self.bucket:
                raise RuntimeError(f"{site}: output {tuple(t.shape)} is not row-wise over {self.bucket} rows")
        graph = self.owner.capture(lambda: self._store(flat, _flatten(fn(*inputs))[0]))
        if not self.owner.enabled:   # the capture failed (logged): this pass goes on eagerly from the warm-up's outputs
            return tuple(warm) if is_tuple else warm[0]
        # the warm-up's outputs are this pass's: a replay now would run a sequence's call (which moves its states
        # on) a second time
        self._store(flat, warm)
        views = [None if b is None else b.view(b.shape) for b in flat]
        for i, view in enumerate(views):
            if view is not None:
                self._writer[(site, i)] = index
                self._made_by[id(view)] = ((site, i), index)
        outputs = tuple(views) if is_tuple else views[0]
        self.calls.append(_Call(site, kinds, graph, outputs))
        return outputs

    def _fill(self, buffer: torch.Tensor, arg: torch.Tensor) -> None:
        """An eager tensor into its static input buffer: the chunk's rows, zeros past them."""
        if arg.shape[1:] != buffer.shape[1:] or arg.shape[0] < self.rows:
            raise RuntimeError(f"an argument {tuple(arg.shape)} does not fit its buffer {tuple(buffer.shape)} "
                               f"({self.rows} rows)")
        buffer[: self.rows].copy_(arg[: self.rows])
        buffer[self.rows:].zero_()

    @staticmethod
    def _store(flat: list, outs: list) -> None:
        for buffer, t in zip(flat, outs):
            if buffer is not None:
                buffer.copy_(t)


class RowGraphs:
    """Row-wise graphs of prefill steps of up to `max_rows` rows, one RowPlan a bucket, one memory pool.
    `sequences`: one sequence's steps also capture its token mixing (ForwardContext.sequence); None: as
    FLASHNEXT_ROW_GRAPHS_SEQUENCES says (on unless 0 — docs/architecture.md)."""

    def __init__(self, device: torch.device, max_rows: int, sequences: bool | None = None):
        self.device = torch.device(device)
        self.max_rows = bucket_rows(max_rows)
        if sequences is None:
            sequences = os.environ.get("FLASHNEXT_ROW_GRAPHS_SEQUENCES", "1") == "1"
        self.sequences = sequences
        self.plans: dict[tuple[int, bool], RowPlan] = {}   # (bucket, one sequence's) → its plan
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.enabled = True
        cuda = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.stream = torch.cuda.Stream(self.device) if cuda else None

    def plan(self, rows: int, slot: int | None = None) -> RowPlan | None:
        """The plan for a step of `rows` rows, begun — of one sequence's rows when `slot` (its state slot) is given;
        None when none fits or capturing failed before."""
        if not self.enabled or rows > self.max_rows:
            return None
        slot = slot if self.sequences else None
        key = (bucket_rows(rows), slot is not None)
        plan = self.plans.get(key)
        if plan is None or not plan.captured:   # new, or a first pass that did not finish (an error inside): start over
            plan = self.plans[key] = RowPlan(self, *key)
        return plan.begin(rows, slot)

    def buffer(self, key: tuple, like: torch.Tensor, rows: int) -> torch.Tensor:
        """The static buffer of `key` (max_rows rows, shaped and typed like `like` past dim 0), its first `rows`."""
        held = self.buffers.get(key)
        if held is None or held.shape[1:] != like.shape[1:] or held.dtype != like.dtype:
            if held is not None:
                raise RuntimeError(f"row-wise site {key}: {tuple(like.shape[1:])} {like.dtype} after "
                                   f"{tuple(held.shape[1:])} {held.dtype}")
            held = self.buffers[key] = torch.zeros(self.max_rows, *like.shape[1:], dtype=like.dtype, device=self.device)
        return held[:rows]

    def capture(self, body) -> torch.cuda.CUDAGraph | _Uncaptured | None:
        """`body` captured into a graph of the shared pool (on a CPU recorded: _Uncaptured). Not torch.cuda.graph,
        which empties the allocator's caches (device and page-locked) at every capture, and a step captures ~200
        calls. A failure (a host sync inside, say) is logged and turns row-wise graphs off for the engine's life;
        the caller then goes on eagerly."""
        if self.device.type != "cuda":
            return _Uncaptured(body)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    body()
                finally:
                    graph.capture_end()
        except Exception:   # noqa: BLE001 - any capture failure falls back to the eager path, loudly
            log.exception("capturing a prefill step's row-wise call failed; prefill steps run eagerly from now on")
            torch.cuda.synchronize(self.device)
            self.release()
            return None
        current.wait_stream(self.stream)
        return graph

    def release(self) -> None:
        """Drop every plan and graph (the buffers go too); later steps run eagerly."""
        self.enabled = False
        for plan in self.plans.values():
            for call in plan.calls:
                call.graph.reset()
        self.plans.clear()
        self.buffers.clear()
        self.pool = None

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
