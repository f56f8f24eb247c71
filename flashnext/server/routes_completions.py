"""POST /v1/completions (legacy): raw prompts — text, token ids, or a batch of either — with `echo`."""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request

from flashnext.engine.structured import openai as structured
from flashnext.server.app import check_model, get_engine, settings_of
from flashnext.server.errors import APIError
from flashnext.server.generation import Fanout, collect, fit_context, jobs_for, sampling_params
from flashnext.server.logprobs import TextOffsets, TokenTexts, completion_logprobs
from flashnext.server.protocol import CompletionRequest, log_unknown_fields
from flashnext.server.streaming import event_stream, sse_response

router = APIRouter()

SYSTEM_FINGERPRINT = "fp_flashnext"
DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for this endpoint


def _prompts(engine, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    vocab = getattr(engine.tokenizer, "vocab_size", None)
    batch = []
    for p in prompt:
        ids = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt must not be empty.", "prompt")
        if any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
            raise APIError(400, f"prompt holds token ids outside the vocabulary [0, {vocab}).", "prompt")
        batch.append(ids)
    return batch


def _check_unsupported(body: CompletionRequest) -> None:
    if body.suffix is not None:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported by this server.", "suffix", "unsupported")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported by this server.", "best_of", "unsupported")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs needs prompt logprobs, which this server does not compute.",
                       "echo", "unsupported")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    log_unknown_fields("completions", body)
    engine, settings = get_engine(request), settings_of(request)
    model = check_model(request, body.model)
    _check_unsupported(body)
    limit = DEFAULT_MAX_TOKENS if body.max_tokens is None and "max_tokens" not in body.model_fields_set else body.max_tokens
    sampling_params(body, max_tokens=limit, logprobs=body.logprobs)
    prompts = _prompts(engine, body.prompt)
    response_format = body.response_format.model_dump() if body.response_format is not None else None
    constraint = await asyncio.to_thread(structured.from_response_format, response_format)
    jobs = []
    cid = f"cmpl-{uuid.uuid4().hex}"
    for p, ids in enumerate(prompts):
        params = sampling_params(body, max_tokens=fit_context(len(ids), limit, engine.max_model_len, prompt_param="prompt"),
                                 logprobs=body.logprobs)
        params.constrain(constraint)
        jobs += jobs_for(cid, ids, params, first_index=p * body.n)
    head = {"id": cid, "created": int(time.time()), "model": model, "system_fingerprint": SYSTEM_FINGERPRINT}
    texts = TokenTexts(engine.tokenizer)
    echoes = [engine.tokenizer.decode(job.prompt_ids) if body.echo else "" for job in jobs]
    fan = Fanout(engine, jobs, request.app.state.metrics)
    if body.stream:
        await fan.admitted(timeout=min(0.5, settings.keepalive_s))
        offsets = [TextOffsets(engine.tokenizer, job.prompt_ids, body.skip_special_tokens) if body.logprobs is not None
                   else None for job in jobs]
        writer = _CompletionChunks(head, echoes, texts, offsets, body.logprobs, body.n,
                                   body.stream_options.include_usage if body.stream_options else False)
        return sse_response(event_stream(fan, writer, settings.keepalive_s))
    results = await collect(request, fan)
    choices = []
    for i, res in enumerate(results):
        if res.finish_reason == "abort":
            raise APIError(503, "The request was aborted by the server (shutting down?).", None, "aborted")
        lp = None
        if body.logprobs is not None:
            offsets = TextOffsets(engine.tokenizer, jobs[i].prompt_ids, body.skip_special_tokens)
            lp = completion_logprobs(res.logprobs, texts, body.logprobs, offsets)
        choices.append({"index": i, "text": echoes[i] + res.text, "logprobs": lp, "finish_reason": res.finish_reason})
    firsts = results[::body.n]
    prompt_tokens = sum(len(ids) for ids in prompts)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sum(r.completion_tokens for r in results),
             "total_tokens": prompt_tokens + sum(r.completion_tokens for r in results),
             "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}
    return {**head, "object": "text_completion", "choices": choices, "usage": usage}


class _CompletionChunks:
    def __init__(self, head: dict, echoes: list[str], texts: TokenTexts, offsets: list[TextOffsets | None],
                 top_k: int | None, n: int, include_usage: bool):
        self.head, self.echoes, self.texts, self.top_k, self.n = head, echoes, texts, top_k, n
        self.include_usage = include_usage
        self.offsets = offsets
        self.prompt = [0] * len(echoes)
        self.cached = [0] * len(echoes)
        self.completion = [0] * len(echoes)

    def _chunk(self, index: int, text: str, finish_reason=None, logprobs=None) -> dict:
        chunk = {**self.head, "object": "text_completion",
                 "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self) -> list[dict]:
        return [self._chunk(i, e) for i, e in enumerate(self.echoes) if e]

    def output(self, index: int, out) -> list[dict]:
        if out.finish_reason == "abort":
            raise APIError(503, "The request was aborted by the server (shutting down?).", None, "aborted")
        self.prompt[index], self.cached[index] = out.prompt_tokens, out.cached_tokens
        self.completion[index] = out.completion_tokens
        logprobs = None
        if self.top_k is not None and out.logprobs:
            logprobs = completion_logprobs(out.logprobs, self.texts, self.top_k, self.offsets[index])
        if not out.text and logprobs is None and not out.finished:
            return []
        return [self._chunk(index, out.text, out.finish_reason, logprobs)]

    def end(self) -> list[dict]:
        if not self.include_usage:
            return []
        prompt = sum(self.prompt[:: self.n])
        completion = sum(self.completion)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": sum(self.cached[:: self.n])}}
        return [{**self.head, "object": "text_completion", "choices": [], "usage": usage}]
