"""POST /v1/chat/completions: template → engine → reasoning/tool-call parsing → OpenAI JSON or SSE."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request

from flashnext.engine.sampling_params import InvalidParams
from flashnext.engine.structured import openai as structured
from flashnext.server import parsers
from flashnext.server.app import check_model, get_engine, settings_of
from flashnext.server.errors import APIError
from flashnext.server.generation import Fanout, collect, fit_context, jobs_for, sampling_params
from flashnext.server.logprobs import TokenTexts, chat_logprobs
from flashnext.server.parsers.messages import ContentDelta, ReasoningDelta, ToolCallArguments, ToolCallStart
from flashnext.server.protocol import ChatCompletionRequest, log_unknown_fields
from flashnext.server.streaming import event_stream, sse_response

router = APIRouter()

SYSTEM_FINGERPRINT = "fp_flashnext"


@dataclass
class RenderedChat:
    prompt_ids: list[int]
    history_len: int | None        # prompt tokens before the generation prompt (Request.history_len)
    tools: list[dict] | None       # what the template saw, and what the parser may call
    reasoning: bool                # parse <think>…</think> at all
    starts_in_reasoning: bool      # the prompt already opened <think>


# What the request's own fields give the template (messages, tools, add_generation_prompt; documents are not taken)
_TEMPLATE_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt")


def _template_kwargs(req) -> dict:
    kwargs = dict(req.chat_template_kwargs or {})
    taken = [key for key in _TEMPLATE_ARGUMENTS if key in kwargs]
    if taken:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do.",
                       "chat_template_kwargs")
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        if effort == "none":
            kwargs.setdefault("enable_thinking", False)
    return kwargs


def _tools_for(req) -> list[dict] | None:
    choice = getattr(req, "tool_choice", None)
    if not req.tools or choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice is not None and not isinstance(choice, str):
        name = choice.function.get("name")
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise APIError(400, f"tool_choice names the function '{name}', which is not in tools.", "tool_choice")
    return tools


async def render_chat(engine, req) -> RenderedChat:
    """Renders with the model's template; a template that rejects the conversation is a 400."""
    from flashnext.tokenizer.chat_template import ChatTemplateError

    tools = _tools_for(req)
    kwargs = _template_kwargs(req)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]

    def render():
        prompt = engine.tokenizer.apply_chat_template(messages, tools=tools,
                                                      add_generation_prompt=req.add_generation_prompt, **kwargs)
        if not isinstance(prompt, str):
            return engine.tokenizer.decode(prompt, skip_special_tokens=False), list(prompt), None
        ids = engine.tokenizer.encode(prompt)
        if not (req.add_generation_prompt and engine.prefix_caching):   # a second render only for a snapshot
            return prompt, ids, None
        history = engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False, **kwargs)
        return prompt, ids, _history_len(engine.tokenizer, prompt, ids, history)

    try:
        text, ids, history_len = await asyncio.to_thread(render)
    except ChatTemplateError as exc:
        raise APIError(400, f"The chat template rejected the messages: {exc}", "messages", "invalid_messages") from None
    reasoning = kwargs.get("enable_thinking", True) is not False
    return RenderedChat(ids, history_len, tools, reasoning, reasoning and text.rstrip().endswith("<think>"))


def _history_len(tokenizer, prompt: str, ids: list[int], history: str) -> int | None:
    """Tokens of `ids` before the generation prompt: the prompt minus what the template added for the reply
    (only the few tokens of the suffix are encoded again). None when the split does not fall on a token
    boundary or the template added nothing."""
    if not prompt.startswith(history) or len(history) == len(prompt):
        return None
    suffix = tokenizer.encode(prompt[len(history):])
    n = len(ids) - len(suffix)
    return n if n > 0 and ids[n:] == suffix else None


def _tool_format(engine, settings) -> str | None:
    fmt = settings.tool_call_parser
    return getattr(engine.tokenizer, "tool_format", None) if fmt == "auto" else fmt


def _parser(engine, settings, rendered: RenderedChat, constraint):
    """The output parser of one choice; under a tool-call grammar (a forced tool choice: every call it lets through is
    well formed) a call's start streams once its name is read."""
    return parsers.ChatOutputParser(_tool_format(engine, settings), rendered.tools, rendered.reasoning,
                                    rendered.starts_in_reasoning,
                                    stream_call_start=constraint is not None and constraint.kind == "tool_calls")


def _constraint(engine, settings, body, rendered: RenderedChat):
    """A forced tool choice or a JSON response_format, as a checked constraint (None: free generation)."""
    reasoning = structured.reasoning_mode(rendered.reasoning, rendered.starts_in_reasoning)
    choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    spec = structured.from_tool_choice(rendered.tools, choice, _tool_format(engine, settings), reasoning,
                                       parallel=body.parallel_tool_calls is not False)
    if spec is None and body.response_format is not None:
        spec = structured.from_response_format(body.response_format.model_dump(), reasoning)
    return spec


def openai_deltas(deltas) -> list[dict]:
    """Parser deltas → OpenAI `delta` objects; neighbouring text of one kind goes into one delta."""
    out: list[dict] = []
    for d in deltas:
        if isinstance(d, ContentDelta):
            if out and set(out[-1]) == {"content"}:
                out[-1]["content"] += d.text
            else:
                out.append({"content": d.text})
        elif isinstance(d, ReasoningDelta):
            if out and set(out[-1]) == {"reasoning_content", "reasoning"}:
                out[-1]["reasoning_content"] += d.text
                out[-1]["reasoning"] += d.text
            else:
                out.append({"reasoning_content": d.text, "reasoning": d.text})
        elif isinstance(d, ToolCallStart):
            out.append({"tool_calls": [{"index": d.index, "id": d.id, "type": d.type,
                                        "function": {"name": d.name, "arguments": ""}}]})
        elif isinstance(d, ToolCallArguments):
            out.append({"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]})
    return out


def _finish_reason(reason: str | None, called_tools: bool) -> str | None:
    if reason == "abort":
        raise APIError(503, "The request was aborted by the server (shutting down?).", None, "aborted")
    return "tool_calls" if called_tools and reason == "stop" else reason


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)}}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    log_unknown_fields("chat.completions", body)
    engine, settings = get_engine(request), settings_of(request)
    model = check_model(request, body.model)
    if body.top_logprobs is not None and not body.logprobs:   # as OpenAI's API answers it
        raise APIError(400, "top_logprobs needs logprobs set to true.", "top_logprobs")
    top_k = (body.top_logprobs or 0) if body.logprobs else None
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    try:  # range errors before the (slower) template
        sampling_params(body, max_tokens=limit, logprobs=top_k)
    except InvalidParams as exc:
        if exc.param in ("logprobs", "max_tokens"):  # chat's names for them
            exc.param = "top_logprobs" if exc.param == "logprobs" else param
        raise
    rendered = await render_chat(engine, body)
    max_tokens = fit_context(len(rendered.prompt_ids), limit, engine.max_model_len, param)
    params = sampling_params(body, max_tokens=max_tokens, logprobs=top_k)
    constraint = await asyncio.to_thread(_constraint, engine, settings, body, rendered)
    params.constrain(constraint)
    output_parsers = [_parser(engine, settings, rendered, constraint) for _ in range(body.n)]
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    head = {"id": cid, "created": int(time.time()), "model": model, "system_fingerprint": SYSTEM_FINGERPRINT}
    texts = TokenTexts(engine.tokenizer)
    fan = Fanout(engine, jobs_for(cid, rendered.prompt_ids, params, history_len=rendered.history_len),
                 request.app.state.metrics)
    if body.stream:
        await fan.admitted(timeout=min(0.5, settings.keepalive_s))
        writer = _ChatChunks(head, output_parsers, texts, top_k,
                             body.stream_options.include_usage if body.stream_options else False)
        return sse_response(event_stream(fan, writer, settings.keepalive_s))
    results = await collect(request, fan)
    choices = []
    for i, res in enumerate(results):
        parsed = output_parsers[i].parse(res.text, truncated=res.finish_reason == "length")
        message = {"role": "assistant", "content": parsed.content if parsed.content or parsed.tool_calls else ""}
        if parsed.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in parsed.tool_calls]
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(res.logprobs, texts, top_k) if top_k is not None else None,
                        "finish_reason": _finish_reason(res.finish_reason, bool(parsed.tool_calls))})
    usage = _usage(len(rendered.prompt_ids), sum(r.completion_tokens for r in results), results[0].cached_tokens)
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage}


class _ChatChunks:
    def __init__(self, head: dict, parsers_: list, texts: TokenTexts, top_k: int | None, include_usage: bool):
        self.head, self.parsers, self.texts, self.top_k = head, parsers_, texts, top_k
        self.include_usage = include_usage
        self.called_tools = [False] * len(parsers_)
        self.completion = [0] * len(parsers_)
        self.opened = [False] * len(parsers_)
        self.prompt_tokens = self.cached_tokens = 0

    def _chunk(self, index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
        chunk = {**self.head, "object": "chat.completion.chunk",
                 "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self) -> list[dict]:
        # A choice's role chunk goes out with its first output (vLLM's serving_chat sends its role chunks at the
        # first engine output too): the first data frame then marks the first generated token, also when the
        # text is held back (a tool call is emitted whole at its end); a long prefill sends keep-alives meanwhile.
        return []

    def output(self, index: int, out) -> list[dict]:
        opening = []
        if not self.opened[index]:
            self.opened[index] = True
            opening.append(self._chunk(index, {"role": "assistant", "content": ""}))
        self.completion[index] = out.completion_tokens
        if index == 0:
            self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        parser = self.parsers[index]
        deltas = openai_deltas(parser.feed(out.text) if out.text else [])
        if out.finished:
            deltas += openai_deltas(parser.finish(truncated=out.finish_reason == "length"))
        logprobs = chat_logprobs(out.logprobs, self.texts, self.top_k) if self.top_k is not None and out.logprobs else None
        if logprobs and not deltas:
            deltas = [{"content": ""}]
        chunks = []
        for delta in deltas:
            self.called_tools[index] |= "tool_calls" in delta
            chunks.append(self._chunk(index, delta, logprobs=logprobs))
            logprobs = None
        if out.finished:
            chunks.append(self._chunk(index, {}, _finish_reason(out.finish_reason, self.called_tools[index])))
        return opening + chunks

    def end(self) -> list[dict]:
        if not self.include_usage:
            return []
        usage = _usage(self.prompt_tokens, sum(self.completion), self.cached_tokens)
        return [{**self.head, "object": "chat.completion.chunk", "choices": [], "usage": usage}]
