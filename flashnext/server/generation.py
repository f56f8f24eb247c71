"""Running one HTTP request's engine requests (n choices × prompts) and tearing them down on disconnect.

Each engine request runs in its own task that pushes outputs into one queue; the HTTP side reads the
queue. Cancelling a task closes its generator and aborts the request, so a client that goes away frees
its pages and slots at once.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace

from fastapi import Request

from flashnext.engine.outputs import RequestOutput, TokenLogprob
from flashnext.engine.sampling_params import InvalidParams, SamplingParams
from flashnext.server.errors import APIError

log = logging.getLogger("flashnext.server")


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    history_len: int | None = None   # chat: prompt tokens before the generation prompt (Request.history_len)


@dataclass
class Finished:
    """A whole choice, accumulated from the engine's increments."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.finish_reason = out.finish_reason
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.completion_tokens = out.completion_tokens


def sampling_params(req, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's params for one choice; range errors come from SamplingParams in its own words."""
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise InvalidParams("logit_bias", f"logit_bias keys must be token ids, got '{key}'.") from None
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    extra = {k: v for k, v in {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                               "min_p": req.min_p, "repetition_penalty": req.repetition_penalty}.items()
             if v is not None}
    return SamplingParams(max_tokens=max_tokens, presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, logit_bias=bias, seed=req.seed,
                          min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop=stop,
                          stop_token_ids=list(req.stop_token_ids or []),
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, n=req.n, **extra)


def fit_context(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str = "max_tokens",
                prompt_param: str = "messages") -> int:
    """max_tokens that fits, or a 400: we never silently truncate a prompt or a requested length."""
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                            f"{prompt_len} tokens, which leaves no room to generate.", prompt_param,
                       "context_length_exceeded")
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                            f"completion). Please reduce the prompt or {param}.", param, "context_length_exceeded")
    return max_tokens


def jobs_for(base_id: str, prompt_ids: list[int], params: SamplingParams, first_index: int = 0,
             history_len: int | None = None) -> list[Job]:
    """n engine requests of one prompt; a seeded request gets seed+i so its choices differ reproducibly."""
    jobs = []
    for i in range(params.n):
        seed = None if params.seed is None else params.seed + i
        jobs.append(Job(prompt_ids, replace(params, n=1, seed=seed), f"{base_id}-{first_index + i}", history_len))
    return jobs


class Fanout:
    """The engine requests of one HTTP request, read as one stream of (choice index, output)."""

    def __init__(self, engine, jobs: list[Job], metrics):
        self.engine, self.jobs, self.metrics = engine, jobs, metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first = [asyncio.get_running_loop().create_future() for _ in jobs]
        self.tasks = [asyncio.create_task(self._pump(i, job)) for i, job in enumerate(jobs)]

    async def _pump(self, index: int, job: Job) -> None:
        gen = self.engine.generate(job.prompt_ids, job.params, job.request_id, job.history_len)
        finished = False
        try:
            async for out in gen:
                if not self.first[index].done():
                    self.first[index].set_result(None)
                finished = out.finished
                if finished:
                    self.metrics.observe_finished(out)
                await self.queue.put((index, out, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the reader, which decides how to tell the client
            if not self.first[index].done():
                self.first[index].set_exception(exc)
                self.first[index].exception()  # mark retrieved; the reader gets it from the queue too
            await self.queue.put((index, None, exc))
        finally:
            await gen.aclose()
            if not finished:
                await _abort(self.engine, job.request_id)
        await self.queue.put((index, None, None))

    async def admitted(self, timeout: float) -> None:
        """Wait up to `timeout` for every request to start; raise at once if one was refused.

        The engine refuses (queue full, prompt too long) when a request is submitted, so this turns those
        into an HTTP status before a stream is opened; a slow prefill just runs into the timeout.
        """
        done, _ = await asyncio.wait(self.first, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        for fut in done:
            if fut.exception() is not None:
                await self.close()
                raise fut.exception()

    async def events(self, timeout: float | None = None):
        """Yields (index, output) until every request finished; yields None after `timeout` s of silence."""
        live = len(self.jobs)
        while live:
            try:
                index, out, exc = await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                yield None
                continue
            if exc is not None:
                raise exc
            if out is None:
                live -= 1
                continue
            yield index, out

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _abort(engine, request_id: str) -> None:
    try:
        await engine.abort(request_id)
    except Exception:  # already gone: nothing left to free
        log.debug("abort of %s failed", request_id, exc_info=True)


async def collect(request: Request, fan: Fanout) -> list[Finished]:
    """All choices to the end, aborting them if the client disconnects first."""
    results = [Finished() for _ in fan.jobs]

    async def run():
        async for index, out in fan.events():
            results[index].add(out)

    runner = asyncio.create_task(run())
    watcher = asyncio.create_task(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({runner, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if runner not in done:
            log.info("client disconnected; aborted %s", ", ".join(j.request_id for j in fan.jobs))
            raise APIError(499, "Client disconnected.")
        runner.result()
    finally:
        for task in (runner, watcher):
            task.cancel()
        await fan.close()
    return results


async def wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body was already read, so receive() only reports that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
