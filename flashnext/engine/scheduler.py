"""Which tokens of which requests run in the next step.

One rule covers prefill, decode and chunked prefill: every request has tokens known and tokens computed,
and a step closes part of each gap within a token budget. Running requests go first (a decode costs one
token), oldest first; then waiting requests are admitted while a state slot, KV blocks and budget last.
When blocks run out, the newest running request is preempted: its slot and blocks are freed and it waits
again, to be recomputed from its tokens (its output so far is kept).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.state_pool import StatePool
from flashnext.engine.request import Request, Status


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int

    @property
    def samples(self) -> bool:
        """A chunk that reaches the last known token produces the next one."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, kv: KVPool, states: StatePool, max_num_seqs: int, token_budget: int):
        self.kv = kv
        self.states = states
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.token_budget
        chunks: list[ScheduledChunk] = []
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:      # preempted while making room for an older request
                continue
            n = min(request.num_uncomputed, budget)
            if not self._reserve_blocks(request, n, chunks):
                continue
            chunks.append(ScheduledChunk(request, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.states.num_free:
            request = self.waiting[0]
            n = min(request.num_uncomputed, budget)
            if self.kv.blocks_for(request.num_computed + n) > self.kv.num_free:
                break
            self.waiting.popleft()
            request.slot = self.states.allocate()
            request.status = Status.RUNNING
            self.running.append(request)
            self._reserve_blocks(request, n, chunks)
            chunks.append(ScheduledChunk(request, n))
            budget -= n
        return chunks

    def _reserve_blocks(self, request: Request, n: int, chunks: list[ScheduledChunk]) -> bool:
        need = self.kv.blocks_for(request.num_computed + n) - len(request.blocks)
        while need > self.kv.num_free:
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
        self._release(request)
        request.num_computed = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        if request in self.running:
            self._release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.release(request.blocks)
        request.blocks = []
        if request.slot is not None:
            self.states.release(request.slot)
            request.slot = None
