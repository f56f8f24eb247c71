"""AsyncLLM: the engine loop on its own thread, requests and outputs through asyncio queues.

The loop owns the device; HTTP handlers never run model code. Requests enter through a lock-protected
inbox and leave as RequestOutput increments pushed into each request's asyncio queue.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from typing import AsyncIterator, Callable

from flashnext.engine.args import EngineArgs
from flashnext.engine.errors import EngineOverloaded
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.outputs import RequestOutput
from flashnext.engine.sampling_params import SamplingParams

log = logging.getLogger("flashnext.engine")
IDLE_WORK_AFTER_S = 0.05


class AsyncLLM:
    def __init__(self, engine: LLMEngine, on_idle: Callable[[], bool] | None = None):
        """`on_idle`: the process's own piece of idle work, asked after the engine's (the server's full garbage
        collections, server/gc_pauses.py) → whether it did any."""
        self.engine = engine
        self.on_idle = on_idle
        self.tokenizer = engine.tokenizer
        self.model_config = engine.config
        self.max_model_len = engine.max_model_len
        self.model_name = engine.model_name
        self.model_path = str(engine.loaded.path)
        self.memory_plan = engine.memory_plan
        self.prefix_caching = engine.prefix_cache is not None   # worth telling where a chat's history ends
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="flashnext-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(LLMEngine(args))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       history_len: int | None = None) -> AsyncIterator[RequestOutput]:
        request_id = request_id or uuid.uuid4().hex
        if self._error is not None:
            raise RuntimeError(f"the engine stopped after an internal error: {self._error}")
        with self._lock:
            if len(self.engine.scheduler.waiting) + sum(1 for m in self._inbox if m[0] == "add") >= self.engine.args.max_queued_requests:
                raise EngineOverloaded(retry_after_s=1.0, message=f"{self.engine.args.max_queued_requests} requests are "
                                       "already waiting; retry later")
        # a grammar compiles on this request's own thread, not on the engine's, where it would stall every stream
        constraint = None if params.structured is None else await asyncio.to_thread(
            self.engine.compile_constraint, params)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done = threading.Event()
        result: list[BaseException | None] = [None]
        with self._lock:
            self._queues[request_id] = (loop, queue)
            self._inbox.append(("add", request_id, prompt_token_ids, params, history_len, constraint, done, result))
        self._wake.set()
        await asyncio.to_thread(done.wait)
        if result[0] is not None:
            with self._lock:
                self._queues.pop(request_id, None)
            raise result[0]
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._queues.pop(request_id, None)
            if not finished:
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def stats(self):
        return self.engine.stats()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # the engine is ours alone again: persist its cache
            self.engine.shutdown()

    # ---- the engine thread ----
    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for message in inbox:
            if message[0] == "add":
                _, request_id, prompt, params, history_len, constraint, done, result = message
                try:
                    self.engine.add_request(request_id, prompt, params, history_len, constraint)
                except BaseException as e:   # a rejection goes back to the caller, never kills the loop
                    result[0] = e
                done.set()
            else:
                self.engine.abort(message[1])

    def _deliver(self, output: RequestOutput) -> None:
        with self._lock:
            target = self._queues.get(output.request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, output)

    def _loop(self) -> None:
        # A step's outputs are delivered once the next step has its work on the device (LLMEngine.step's
        # `launched`): the handlers that wake up for them (detokenised text to JSON and SSE) then hold the GIL
        # while the GPU computes, not while this thread prepares and launches the next step.
        held: list[RequestOutput] = []

        def deliver_held() -> None:
            for output in held:
                self._deliver(output)
            held.clear()

        idle_working = False   # the last pass did a piece of background work
        while not self._stopped:
            self._drain_inbox()
            if not self.engine.has_work():
                deliver_held()
                # background work only after IDLE_WORK_AFTER_S without a request (a client's next request often
                # follows its last reply within milliseconds), then one piece after the other, the inbox checked
                # in between
                if not idle_working and self._wake.wait(timeout=IDLE_WORK_AFTER_S):
                    self._wake.clear()
                    continue
                # a wake-up meanwhile stays set for the wait below
                idle_working = self.engine.idle_work() or (self.on_idle is not None and self.on_idle())
                if idle_working:
                    continue
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            idle_working = False
            try:
                outputs = self.engine.step(launched=deliver_held)
            except BaseException as e:
                log.exception("engine step failed")
                deliver_held()
                self._fail_all(e)
                continue
            held.extend(outputs)
        deliver_held()

    def _fail_all(self, error: BaseException) -> None:
        """An internal failure ends the running requests with an error; the engine keeps serving new ones."""
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            with self._lock:
                target = self._queues.get(request_id)
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(f"generation failed: {error}"))
