"""The decode step as captured CUDA graphs: one graph per (batch bucket, block-table width bucket).

A decode step of Flash-Next is ~1,700 kernels (BENCHMARKS.md); launched from Python each costs ~8–24 µs, replayed
from a graph ~1.25 µs (../shared/PERF.md). So one-token steps of sequences under way (decodes, and a prompt's
last few tokens fed one a step: Scheduler.graph_tail) replay a graph of `model.decode` + `compute_logits` over
static input tensors (models/decode_batch.py); other prefill chunks stay eager.

Buckets: the batch rounds up to a power of two (rows past the real batch point at a scratch state slot and
a scratch KV block, reserved here for good, so their writes land where nobody reads), and the block table
width rounds up to a power of two of at least 16 blocks (attention and the QSA indexer read per step what
the table holds, so a short context does not pay for the longest). Graphs are captured on first use (one
sequence's at every width already at the engine's warm-up on one GPU) and share one memory pool. `--enforce-eager` turns all of this off (debugging; docs/architecture.md).
On a CPU nothing is captured: `run` executes the same fixed-shape step eagerly, which is how the tests cover
the buckets, the padding and the scratch rows without a GPU.

Short prompt chunks of a sequence under way (a resumed conversation's new message, an agent's tool result, the
generation prompt after a turn's history) go through `extend`: chained steps (models/decode_batch.py) of exact
power-of-two sizes, the largest first, so no padding row ever reaches the sequence's token-by-token states — 75
tokens are steps of 64, 8 and 2 and one decode step. Each (size, width) is a graph of its own beside the decode
ones, captured on first use or at warm-up (`capture_widths`). An eager step of a short chunk cost 120–150 ms of
host time on the H200 (Flash-Next INT4, ~4,000–4,600 launches) however few its tokens.
"""
from __future__ import annotations

import logging
import time

import torch

from flashnext.models.decode_batch import DecodeBatch
from flashnext.weights.pinned import staged

log = logging.getLogger("flashnext.engine")

MIN_WIDTH = 16
# The narrowest table a chained step is captured with (4,096 tokens of 16): its width buckets are captured at warm-up
# for every size, 7 sizes × 11 widths took 38 s of the server's warm-up on the H200 (full-size Flash-Next). Below it
# a wider table should cost a chained step little — each row still attends up to its own position, the QSA indexer
# scores the table's block slots — not measured.
CHAIN_MIN_WIDTH = 256


def bucket(n: int, smallest: int = 1) -> int:
    return max(smallest, 1 << max(0, n - 1).bit_length())


# The largest chained step: per token the cheapest of those timed (H200, Flash-Next INT4, at 58K: 66.7 ms for 128
# rows against 52.6 for 64 and 34.0 for 32, session 14); a longer chunk takes several.
CHAIN_MAX_STEP = 128


def chain_sizes(n: int, largest: int = CHAIN_MAX_STEP) -> list[int]:
    """`n` as the chained steps `extend` runs, the largest first: steps of `largest` (a power of two), then the
    binary digits of the rest (75 → [64, 8, 2, 1]; 300 → [128, 128, 32, 8, 4])."""
    rest = n % largest
    return [largest] * (n // largest) + [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]


# What one step changes in a slot's device block table: (slot, reset first?, first row, block ids from there).
TableDelta = tuple[int, bool, int, list[int]]


class DecodeGraphs:
    def __init__(self, model, kv, states, max_batch: int, max_blocks_per_seq: int,
                 scratch: tuple[int, int] | None = None, max_chain: int = 0):
        """`scratch` (slot, block): the padding rows' slot and block, reserved by rank 0's twin when this runs on a
        worker rank of several GPUs (parallel/runtime.py); None: reserve them here. `max_chain`: the most tokens
        `extend` takes (0: none)."""
        self.model = model
        self.kv = kv
        self.states = states
        self.device = kv.device
        self.max_batch = bucket(max_batch)
        self.max_width = bucket(max_blocks_per_seq, MIN_WIDTH)
        self.scratch_slot, self.scratch_block = scratch or (states.allocate(), kv.allocate(1)[0])
        # Several GPUs: rank 0 tells the workers each step's inputs before it runs (parallel/runtime.py), so that
        # every rank replays its own graph and the all-reduces inside meet.
        self.announce = None
        # An expert cache's pools' keeper (ExpertCache.enable_graphs), told before and after every step on every
        # rank: its kernels skip the bucket's padding rows, and its pools adapt or count around the steps
        self.keeper = None
        long = dict(dtype=torch.long, device=self.device)
        # The static inputs, one row each (token, position, slot), filled by one host→device copy per step.
        self.inputs = torch.zeros(3, self.max_batch, **long)
        self.input_ids, self.positions, self.slots = self.inputs
        self.slots.fill_(self.scratch_slot)
        # The sizes of the chained steps `extend` may run (powers of two from 2 to max_chain, CHAIN_MAX_STEP at most),
        # and their static inputs: up to the largest's rows of one sequence.
        self.chain_steps = [1 << i for i in range(1, max(0, min(max_chain, CHAIN_MAX_STEP)).bit_length())]
        self.chain_inputs = torch.zeros(3, max(self.chain_steps, default=1), **long)
        # Every slot's KV block table lives on the device and grows by the blocks appended since the last step
        # (a long context is thousands of block ids: not rebuilt from a Python list every token); the step
        # gathers its rows' tables from it by slot, inside the graph.
        self.slot_tables = torch.full((states.num_slots, self.max_width), self.scratch_block, **long)
        self._slot_blocks: dict[int, tuple[list[int], int]] = {}   # slot → (its request's block list, rows known)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.chain_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.pool = None
        self.capture = self.device.type == "cuda"

    def release(self) -> None:
        """Free every captured graph; later steps run the same fixed-shape step uncaptured. Several GPUs: before
        leaving the NCCL group, or its teardown waits for ever on the collectives captured inside
        (pytorch/pytorch#115388; on 2 × H200 both ranks hung in destroy_process_group)."""
        if self.capture:
            torch.cuda.synchronize(self.device)
        for graphs in (self.graphs, self.chain_graphs):
            for graph, _ in graphs.values():
                if graph is not None:
                    graph.reset()
            graphs.clear()
        self.pool = None
        self.capture = False

    def can_run(self, batch_size: int, max_blocks: int) -> bool:
        return batch_size <= self.max_batch and max_blocks <= self.max_width

    def captured(self, batch_size: int, max_blocks: int) -> bool:
        """Whether the step for this batch and block-table width exists (`run` would otherwise capture it first)."""
        return (bucket(batch_size), bucket(max_blocks, MIN_WIDTH)) in self.graphs

    def run(self, input_ids: list[int] | torch.Tensor, positions: list[int], slots: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Logits [n, vocab] of one new token per sequence (the rows' states and KV pages advance). `input_ids` may
        be a LongTensor on the device: the tokens the step before sampled, not yet read by the host (decode ahead,
        LLMEngine.step); one GPU only (workers are told their inputs from the host)."""
        width = bucket(max(len(t) for t in block_tables), MIN_WIDTH)
        deltas = [self._table_delta(slot, blocks) for slot, blocks in zip(slots, block_tables)]
        if self.announce is not None:
            self.announce(self, input_ids, positions, slots, width, deltas)
        return self.step(input_ids, positions, slots, width, deltas)

    def capture_widths(self, size: int, chained: bool = False) -> int:
        """Capture the step for batch `size` (or the chained step of `size` rows) at every table width not captured
        yet (engine warm-up on one GPU: a conversation resumed at 58K tokens otherwise paid a 0.2–0.3 s capture
        before its second token on the H200). → how many were captured."""
        graphs, size = (self.chain_graphs, size) if chained else (self.graphs, bucket(size))
        width, count = self._chain_width(0) if chained else MIN_WIDTH, 0
        while width <= self.max_width:
            if (size, width) not in graphs:
                self._capture(size, width, chained)
                count += 1
            width *= 2
        return count

    def extend(self, tokens: list[int], start: int, slot: int, blocks: list[int]) -> torch.Tensor:
        """Logits [1, V] of the last of `tokens` (the scheduler picks such chunks: Scheduler._chains), which continue
        the sequence in `slot` at position `start` > 0 (its states and KV pages advance; the chained steps never clear a
        slot): chained steps of chain_sizes(len(tokens), the largest of chain_steps), a last single token a decode step.
        A copy: the graphs' static outputs are overwritten by their next replay (another chunk's, the step's decodes)."""
        width = self._chain_width(len(blocks))
        deltas = [self._table_delta(slot, blocks)]
        done, logits = 0, None
        for size in chain_sizes(len(tokens), self.chain_steps[-1]):
            ids, positions = tokens[done: done + size], list(range(start + done, start + done + size))
            if size == 1:   # the decode step at its own width, as a decode of this sequence would run it
                logits = self.step(ids, positions, [slot], bucket(len(blocks), MIN_WIDTH), deltas)
            else:
                logits = self._chain_step(ids, positions, slot, width, deltas)
            done, deltas = done + size, []
        return logits.clone()

    def _chain_width(self, num_blocks: int) -> int:
        return min(max(bucket(num_blocks, MIN_WIDTH), CHAIN_MIN_WIDTH), self.max_width)

    def _chain_step(self, ids: list[int], positions: list[int], slot: int, width: int,
                    deltas: list[TableDelta]) -> torch.Tensor:
        size = len(ids)
        if (size, width) not in self.chain_graphs:
            self._capture(size, width, chained=True)
        graph, logits = self.chain_graphs[(size, width)]
        self._apply_deltas(deltas)
        self.chain_inputs[:, :size].copy_(staged([ids, positions, [slot] * size], self.device), non_blocking=True)
        if graph is None:
            return self._step(size, width, chained=True)
        graph.replay()
        return logits

    def step(self, input_ids: list[int] | torch.Tensor, positions: list[int], slots: list[int], width: int,
             deltas: list[TableDelta]) -> torch.Tensor:
        """`run` once the table changes are known: what a worker rank runs for rank 0's announcement, and `extend`
        for a chunk's last token."""
        n = len(input_ids)
        size = bucket(n)
        key = (size, width)
        if key not in self.graphs:
            self._capture(size, width)
        graph, logits = self.graphs[key]
        pad = size - n
        on_device = isinstance(input_ids, torch.Tensor)
        host = staged([([0] * n if on_device else input_ids) + [0] * pad, positions + [0] * pad,
                       slots + [self.scratch_slot] * pad], self.device)
        self._apply_deltas(deltas)
        self.inputs[:, :size].copy_(host, non_blocking=True)
        if on_device:
            self.input_ids[:n].copy_(input_ids)
        if self.keeper is not None:
            self.keeper.before_step(n)
        if graph is None:
            logits = self._step(size, width)
        else:
            graph.replay()
        if self.keeper is not None:
            self.keeper.after_step()
        return logits[:n]

    def _apply_deltas(self, deltas: list[TableDelta]) -> None:
        for slot, reset, first, blocks in deltas:
            if reset:
                self.slot_tables[slot].fill_(self.scratch_block)
            if blocks:
                self.slot_tables[slot, first: first + len(blocks)].copy_(staged(blocks, self.device), non_blocking=True)

    def _table_delta(self, slot: int, blocks: list[int]) -> TableDelta:
        """The blocks this slot's table lacks. A request's block list is only ever extended, or replaced by a
        new list (a new request in the slot, a resume): held by reference, so `is` tells them apart."""
        known, count = self._slot_blocks.get(slot, (None, 0))
        reset = known is not blocks and known is not None
        if known is not blocks:
            count = 0
        self._slot_blocks[slot] = (blocks, len(blocks))
        return slot, reset, count, blocks[count:]

    def batch(self, size: int, width: int, chained: bool = False) -> DecodeBatch:
        """The first `size` rows of the static inputs (the chained steps' when `chained`), their block tables
        gathered by slot. A new DecodeBatch per call: inside a capture, whatever it caches (its token rows) is
        computed in the graph from the inputs."""
        input_ids, positions, slots = (self.chain_inputs if chained else self.inputs)[:, :size]
        table = self.slot_tables[:, :width].index_select(0, slots)
        return DecodeBatch(input_ids, positions, slots, table, self.kv, self.states, chained=chained)

    def _step(self, size: int, width: int, chained: bool = False) -> torch.Tensor:
        hidden = self.model.decode(self.batch(size, width, chained))
        return self.model.compute_logits(hidden[-1:] if chained else hidden)   # a chain: its last token's only

    @torch.inference_mode()
    def _capture(self, size: int, width: int, chained: bool = False) -> None:
        graphs = self.chain_graphs if chained else self.graphs
        if not self.capture:
            graphs[(size, width)] = (None, None)
            return
        start = time.perf_counter()
        # Warm-up and capture read the static inputs: point every row at the scratch slot (whose table is all the
        # scratch block) first, so the warm-up runs (which do execute) write only there.
        inputs = self.chain_inputs if chained else self.inputs
        inputs[:2].zero_()
        inputs[2].fill_(self.scratch_slot)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles and autotunes the Triton kernels outside the capture
                self._step(size, width, chained)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        what = f"the {'chained' if chained else 'decode'} step for batch {size}, {width} KV blocks wide"
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._step(size, width, chained)
        except RuntimeError as exc:
            # e.g. a collective that cannot be captured with several GPUs: this bucket keeps the same fixed-shape
            # step, run eagerly (on another rank a captured graph launches the same collectives in the same order)
            log.warning("capturing %s failed (%s); it runs eagerly", what,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            graphs[(size, width)] = (None, None)
            return
        self.pool = graph.pool()
        graphs[(size, width)] = (graph, logits)
        log.info("captured %s in %.2f s", what, time.perf_counter() - start)
