"""Which tokens of which requests run in the next step.

One rule covers prefill, decode and chunked prefill: every request has tokens known and tokens computed,
and a step closes part of each gap within a token budget. Running requests go first (a decode costs one
token), oldest first; then waiting requests are admitted while a state slot, KV blocks and budget last.
When blocks run out, the prefix cache gives back least recently used entries first; then the newest
running request is preempted: it is snapshotted into the prefix cache (when there is one), its slot and
blocks are freed, and it waits again, to resume from that snapshot or be recomputed from its tokens.

While any running sequence decodes, prefill chunks (of running and newly admitted requests together) share
a smaller budget, `prefill_budget_while_decoding` (or what a PrefillPacer's step-time budget allows): a step
with a long prefill chunk stalls every decoding stream for as long as the chunk takes, while a prefill alone
runs at the full budget (larger chunks keep the GEMMs busier). With `decode_steps_between_prefill` K > 0, each
step that carries an eager prefill chunk while others decode is followed by K steps of decodes alone (and the chunks
that replay captured graphs: prompt tails fed one token a step, chained chunks — `_chains`; a waiting request, a
resumed conversation too, is admitted only on the steps between), as SGLang alternates
prefill and decode batches: an eager prefill step costs full-size
Flash-Next ~150 ms of host time however small its chunk, so a shorter chunk cannot make a mixed step short; the
streams get K fast tokens per prefill chunk instead, and the prompt enters K steps slower a chunk.

With a prefix cache, an admitted request first resumes from the deepest cached snapshot of its tokens
(never all of them: the last token must run to give logits) — when that snapshot is on disk, its files are
read in the background and the request waits, skipped, while the others run (PrefixCache.lookup → LOADING); a snapshot is taken at the end of the first
prefill chunk that reaches or crosses each multiple of the snapshot interval inside the prompt, at the end
of the prompt — or, for a chat request, where its conversation ends before the template's generation prompt
(history_len: where the next turn diverges) — and at the end of every reply.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.prefix_cache import LOADING, PrefixCache
from flashnext.cache.state_pool import StatePool
from flashnext.engine.prefill_pacer import PrefillPacer
from flashnext.engine.request import Request, Status


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int
    chained: bool = False   # replays chained graph steps (Scheduler._chains, DecodeGraphs.extend)

    @property
    def samples(self) -> bool:
        """A chunk that reaches the last known token produces the next one."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, kv: KVPool, states: StatePool, max_num_seqs: int, token_budget: int,
                 prefix_cache: PrefixCache | None = None, snapshot_interval: int = 0,
                 prefill_budget_while_decoding: int | None = None, pacer: PrefillPacer | None = None,
                 graph_tail: int = 0, decode_steps_between_prefill: int = 0, extend_max: int = 0):
        self.kv = kv
        # A prompt chunk of at most this many tokens goes one token a step, so the captured decode graph runs it
        # (ModelRunner._graph_chunks): the engine sets it when it has decode graphs but no chained steps (below:
        # those take such chunks whole). On the H200 an eager prefill
        # step of full-size Flash-Next INT4 costs 120–150 ms of host time however few its tokens (~4,000 kernel
        # launches), a graph step 6–8 ms a token; an agent's turn ends its prompt with such a chunk (the generation
        # prompt after the history cut, ~5 tokens), and a short tool result after a prefix hit is one too.
        self.graph_tail = graph_tail
        # A prompt chunk of 2 to extend_max tokens of a sequence under way replays chained graph steps instead
        # (DecodeGraphs.extend, ModelRunner): the engine sets it where those run, and graph_tail to 0 then.
        self.extend_max = extend_max
        self.states = states
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.prefill_budget_while_decoding = prefill_budget_while_decoding or token_budget
        self.pacer = pacer     # a step-time budget instead of the fixed prefill_budget_while_decoding
        self.decode_steps_between_prefill = decode_steps_between_prefill
        self._decode_only_steps = 0    # steps left before the next prefill chunk may run beside decodes
        self.prefix_cache = prefix_cache
        self.snapshot_interval = snapshot_interval if prefix_cache is not None else 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queries = 0      # prompt tokens of admitted requests (first admission only)
        self.prefix_hits = 0         # of which served from the prefix cache

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.token_budget
        decoding = any(r.num_tokens - r.num_computed == 1 for r in self.running)
        while_decoding = self.pacer.tokens() if self.pacer is not None else self.prefill_budget_while_decoding
        prefill_budget = min(budget, while_decoding) if decoding else budget
        decode_only = decoding and self._take_decode_only_step()
        chunks: list[ScheduledChunk] = []
        prefilled = False
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:      # preempted while making room for an older request
                continue
            decode = request.num_tokens - request.num_computed == 1
            if not decode and prefill_budget == 0:
                continue
            n = self._chunk_len(request, request.num_computed, budget if decode else min(budget, prefill_budget))
            chained = self._chains(request, request.num_computed, n)
            replayed = self._replays(request.num_computed, n, chained)
            if decode_only and not replayed:     # an eager prefill chunk waits; what graphs replay goes
                continue
            if not self._reserve_blocks(request, n, chunks):
                continue
            chunks.append(ScheduledChunk(request, n, chained))
            budget -= n
            prefilled |= not replayed
            if not decode:
                prefill_budget -= n
        # what is left is for admitting waiting requests (prefill), none on a decode-only step
        budget = 0 if decode_only else min(budget, prefill_budget)
        for request in list(self.waiting):
            if not (budget > 0 and self._has_room()):
                break
            hit = None
            if self.prefix_cache is not None:
                if self._reading(request):
                    continue
                hit = self.prefix_cache.lookup(request.all_ids, request.num_tokens - 1, owner=request.request_id)
                if hit is LOADING:
                    continue
            shared = hit.blocks if hit is not None else []
            start = hit.num_tokens if hit is not None else 0
            n = self._chunk_len(request, start, budget)
            need = self.kv.blocks_for(start + n) - len(shared)
            self.kv.share(shared)            # held before evicting, so eviction cannot free them
            if need > self.kv.num_free and self.prefix_cache is not None:
                self.prefix_cache.free_blocks(need)
            if need > self.kv.num_free:
                self.kv.unshare(shared)
                break
            self.waiting.remove(request)
            if self.prefix_cache is not None:
                self.prefix_cache.forget_read(request.request_id)
            request.slot = self.states.allocate()
            request.status = Status.RUNNING
            request.blocks = shared + self.kv.allocate(need)
            if hit is not None:
                self.prefix_cache.resume(request.slot, request.blocks, hit)
            request.num_computed = start
            if not request.prefix_counted:
                request.prefix_counted = True
                request.num_cached = start
                self.prefix_queries += len(request.prompt_ids)
                self.prefix_hits += start
            self.running.append(request)
            chained = self._chains(request, start, n)
            chunks.append(ScheduledChunk(request, n, chained))
            budget -= n
            prefilled |= not self._replays(start, n, chained)
        if prefilled and decoding:
            self._decode_only_steps = self.decode_steps_between_prefill
        return chunks

    def schedule_ahead(self, requests: list[Request], can_run: Callable[[int], bool]) -> list[ScheduledChunk] | None:
        """The decode step after the one now sampling `requests`' next tokens (every running request, in that step's
        order), as schedule() would pick it once those tokens are appended: one token each, their KV blocks reserved
        — or None where schedule() might pick another: a waiting request could be admitted (may_admit), a running
        request is not in that step or has prompt left, one is finished or at its max_model_len, or a KV block is
        missing and none is free (nothing is evicted ahead). `can_run(widest)`: whether the runner can queue it, its
        block tables that many blocks wide at most."""
        if self.may_admit():
            return None
        if len(requests) != len(self.running) or any(
                r.finished or r.num_computed != r.num_tokens or r.num_tokens >= r.max_model_len for r in requests):
            return None
        needs = [self._blocks_needed(r, 1) for r in requests]
        if sum(needs) > self.kv.num_free or not can_run(max(len(r.blocks) + n for r, n in zip(requests, needs))):
            return None
        for r, need in zip(requests, needs):
            if need > 0:
                r.blocks.extend(self.kv.allocate(need))
        self._take_decode_only_step()   # a decode-only step like schedule()'s
        return [ScheduledChunk(r, 1) for r in requests]

    def _take_decode_only_step(self) -> bool:
        """Count one of the decode-only steps owed after a prefill chunk (--decode-steps-between-prefill): whether
        one was owed."""
        if self._decode_only_steps > 0:
            self._decode_only_steps -= 1
            return True
        return False

    def may_admit(self) -> bool:
        """Whether the next schedule() may admit a waiting request: one waits that is not held by a disk read, and a
        sequence slot is free."""
        return self._has_room() and any(not self._reading(r) for r in self.waiting)

    def _has_room(self) -> bool:
        return len(self.running) < self.max_num_seqs and self.states.num_free > 0

    @staticmethod
    def _replays(start: int, n: int, chained: bool) -> bool:
        """Whether a chunk replays captured graphs (not the eager prefill that decode-only steps hold back): a chained
        chunk, or one token of a sequence under way (a decode, a prompt tail)."""
        return chained or n == 1 and start > 0

    def _chains(self, request: Request, start: int, n: int) -> bool:
        """Whether the chunk of `n` tokens from `start` replays chained graph steps (DecodeGraphs.extend): several
        tokens, up to extend_max, of a sequence under way, ending its prompt or its history (a resumed conversation's
        new message, a tool result, the generation prompt). A chunk the budget cut short stays eager: the prompt goes
        on in large chunks, and the pacer times eager steps."""
        end = start + n
        return 1 < n <= self.extend_max and start > 0 and end in (request.num_tokens, request.history_len)

    def _reading(self, request: Request) -> bool:
        """Its cached prefix is being read from disk: the requests behind it go first (no lookup until done)."""
        return self.prefix_cache is not None and self.prefix_cache.waiting_for_read(request.request_id)

    def _chunk_len(self, request: Request, start: int, budget: int) -> int:
        """Tokens of the next chunk: the budget's worth. Interval snapshots never cut a chunk short (computed()
        takes them at the first chunk end past each interval mark): on the H200 a 10K Flash-Next prompt prefilled
        at 4.1K tok/s through the server when snapshots cut it into 1024-token chunks, and at 7.9K tok/s in the
        engine with 8192-token chunks. The one cut is at the request's history_len, the snapshot the
        conversation's next turn resumes from: it costs one short chunk (the generation prompt's few tokens), which
        with decode graphs replays chained steps (extend_max) or, where those cannot run, goes one token a step
        (graph_tail)."""
        remaining = request.num_tokens - start
        n = min(remaining, budget)
        history = request.history_len
        cut = history is not None and start < history < start + n
        if cut:
            n = history - start
        # A short chunk that ends at the cut or the prompt's end (not one the budget cut short) goes token by token
        # — unless it starts the sequence: the decode step continues a slot's states and never clears them.
        return 1 if 0 < start and n <= self.graph_tail and (cut or n == remaining) else n

    def _blocks_needed(self, request: Request, n: int) -> int:
        """KV blocks `request` lacks for its next `n` tokens."""
        return self.kv.blocks_for(request.num_computed + n) - len(request.blocks)

    def _reserve_blocks(self, request: Request, n: int, chunks: list[ScheduledChunk]) -> bool:
        need = self._blocks_needed(request, n)
        while need > self.kv.num_free:
            if self.prefix_cache is not None and self.prefix_cache.free_blocks(need):
                break
            victim = self.running[-1]
            if victim is request:
                self.preempt(request)
                return False
            self.preempt(victim)
            chunks[:] = [c for c in chunks if c.request is not victim]
        if need > 0:
            request.blocks.extend(self.kv.allocate(need))
        return True

    def preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        self.snapshot(request)
        self._release(request)
        request.num_computed = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)

    def computed(self, chunks: list[ScheduledChunk]) -> None:
        """After a step: advance each request; snapshot those that reached their history_len (kept like a turn
        end: the host tier's write-through takes it too), or else finished their prompt, or whose chunk reached
        or crossed a multiple of the snapshot interval."""
        for c in chunks:
            r = c.request
            before = r.num_computed
            r.num_computed += c.num_tokens
            n, prompt = r.num_computed, len(r.prompt_ids)
            crossed = self.snapshot_interval and before // self.snapshot_interval < n // self.snapshot_interval
            if n == r.history_len:
                self.snapshot(r, turn_end=True)
            # With a history_len the prompt's end, a few tokens further, is not kept as well: a re-sent prompt
            # resumes from the history's end, and the device's snapshot budget (116 MB of state each on
            # Flash-Next) holds one per turn instead of two.
            elif n == prompt and r.history_len is None:
                self.snapshot(r)
            elif crossed and n < prompt:
                self.snapshot(r, inside_prefill=True)

    def snapshot(self, request: Request, turn_end: bool = False, inside_prefill: bool = False) -> None:
        """Put the request's computed prefix (KV blocks + its slot's state) into the prefix cache."""
        if self.prefix_cache is not None and request.slot is not None:
            self.prefix_cache.insert(request.all_ids, request.blocks, request.slot, request.num_computed, turn_end,
                                     inside_prefill)

    def finish(self, request: Request) -> None:
        if request in self.running:
            if request.finish_reason != "abort":
                self.snapshot(request, turn_end=True)
            self._release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
            if self.prefix_cache is not None:
                self.prefix_cache.forget_read(request.request_id)    # a disk read started for it is let go
        request.status = Status.FINISHED

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.release(request.blocks)
        request.blocks = []
        if request.slot is not None:
            self.states.release(request.slot)
            request.slot = None
