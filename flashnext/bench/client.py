"""A small async client for OpenAI-compatible streaming chat completions that times every delta.

Our own SSE reader instead of the openai package: the time of the first delta must be taken when its
bytes arrive, not after a library has parsed and buffered them.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from flashnext.bench.stats import decode_rate

# PERF.md: every benchmark request samples with these settings and thinking off.
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}


class BenchError(RuntimeError):
    """The server answered something the benchmark cannot use; the message says what and where."""


@dataclass
class StreamResult:
    """Everything measured about one streamed request. Times are seconds from sending the request."""
    t_start: float                      # wall clock (epoch seconds) when the request was sent
    ttft_s: float | None                # first content, reasoning or tool-call delta (see ttft_source)
    wall_s: float                       # end of the stream
    last_delta_s: float | None
    prompt_tokens: int | None           # from usage
    completion_tokens: int | None
    cached_tokens: int | None           # usage.prompt_tokens_details.cached_tokens
    n_deltas: int
    finish_reason: str | None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    # "delta"; or "finish" when the reply had no visible delta at all (a random-weight model that
    # says only EOS): then the chunk that ended the choice is the first sign of the first token.
    ttft_source: str | None = None
    # the first data chunk with a choice in it (its role, as a rule): the first generated token on servers
    # that open a choice with it (ours, vLLM's), also when the text comes later (a tool call held
    # until it is complete); None when no chunk had a choice
    first_chunk_s: float | None = None

    @property
    def decode_tok_s(self) -> float | None:
        return decode_rate(self.completion_tokens or 0, self.wall_s, self.ttft_s, self.n_deltas)

    def sample(self, **extra) -> dict:
        """The raw numbers of this request for the results file (text is left out, only its size)."""
        return {
            "t_start": self.t_start, "ttft_s": self.ttft_s, "wall_s": self.wall_s,
            "last_delta_s": self.last_delta_s, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
            "n_deltas": self.n_deltas, "finish_reason": self.finish_reason,
            "content_chars": len(self.content), "reasoning_chars": len(self.reasoning),
            "tool_calls": len(self.tool_calls), "decode_tok_s": self.decode_tok_s, "ttft_source": self.ttft_source,
            "first_chunk_s": self.first_chunk_s, **extra,
        }


def api_root(url: str) -> str:
    """Accept http://host:port, …/ or …/v1 alike; endpoints are built from the server root."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class OpenAIClient:
    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 request_timeout_s: float = 3600.0, transport: httpx.AsyncBaseTransport | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.root = api_root(url)
        self.model = model
        self._http = httpx.AsyncClient(
            base_url=self.root, headers=headers,
            timeout=httpx.Timeout(request_timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64), transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def get_json(self, path: str) -> dict | list | None:
        """GET an optional endpoint: None when the server does not have it."""
        try:
            r = await self._http.get(path)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            return r.json()
        except ValueError:
            return None

    async def get_text(self, path: str) -> str | None:
        try:
            r = await self._http.get(path)
        except httpx.HTTPError:
            return None
        return r.text if r.status_code == 200 else None

    async def model_id(self) -> str:
        models = await self.get_json("/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not data:
            raise BenchError(f"{self.root}/v1/models lists no model; pass --model-name.")
        return data[0]["id"]

    async def count_tokens(self, text: str) -> int | None:
        """Tokens of `text` by the server's own tokenizer, or None when it has no /tokenize.

        vLLM (and ours) take {"model", "prompt"} and answer {"count"| "tokens"}; llama.cpp takes {"content"}.
        """
        for body in ({"model": self.model, "prompt": text, "add_special_tokens": False}, {"content": text}):
            try:
                r = await self._http.post("/tokenize", json=body)
            except httpx.HTTPError:
                return None
            if r.status_code == 404:
                return None
            if r.status_code != 200:
                continue
            data = r.json()
            if isinstance(data.get("count"), int):
                return data["count"]
            if isinstance(data.get("tokens"), list):
                return len(data["tokens"])
        return None

    async def chat(self, messages: list[dict], max_tokens: int, **kw) -> StreamResult:
        """One streamed chat completion with the protocol's sampling; returns its timings and usage."""
        try:
            return await self._chat(messages, max_tokens, **kw)
        except httpx.HTTPError as e:  # a dropped connection or a timeout: the server died or hung
            raise BenchError(f"{self.root}/v1/chat/completions: {type(e).__name__}: {e}") from e

    async def _chat(self, messages: list[dict], max_tokens: int, *, ignore_eos: bool = False,
                    tools: list[dict] | None = None, tool_choice: str | None = None,
                    on_delta: Callable[[int], None] | None = None) -> StreamResult:
        body: dict = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **SAMPLING,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        if ignore_eos:
            body.update(ignore_eos=True, min_tokens=max_tokens)
        if tools:
            body["tools"] = tools
            if tool_choice:
                body["tool_choice"] = tool_choice
        t_start = time.time()
        t0 = time.perf_counter()
        ttft = last = finished_at = first_chunk = None
        n_deltas = 0
        usage: dict | None = None
        finish_reason = None
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, dict] = {}
        async with self._http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:2000]
                raise BenchError(f"POST {self.root}/v1/chat/completions answered {r.status_code}: {text}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter() - t0
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise BenchError(f"the stream carried an error: {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices") and first_chunk is None:
                    first_chunk = now
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or ""
                    think = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    tool_deltas = delta.get("tool_calls") or []
                    if text or think or tool_deltas:
                        n_deltas += 1
                        last = now
                        if ttft is None:
                            ttft = now
                        if on_delta is not None:
                            on_delta(n_deltas)
                    content.append(text)
                    reasoning.append(think)
                    for tc in tool_deltas:
                        _merge_tool_call(calls, tc)
                    if choice.get("finish_reason"):
                        finish_reason = choice["finish_reason"]
                        finished_at = now if finished_at is None else finished_at
        wall = time.perf_counter() - t0
        if usage is None:
            raise BenchError(f"{self.root} sent no usage chunk although stream_options.include_usage was set.")
        details = usage.get("prompt_tokens_details") or {}
        source = "delta" if ttft is not None else "finish" if finished_at is not None else None
        return StreamResult(
            t_start=t_start, ttft_s=ttft if ttft is not None else finished_at, wall_s=wall, last_delta_s=last,
            prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
            cached_tokens=details.get("cached_tokens"), n_deltas=n_deltas, finish_reason=finish_reason,
            content="".join(content), reasoning="".join(reasoning),
            tool_calls=[calls[i] for i in sorted(calls)], ttft_source=source, first_chunk_s=first_chunk)


def _merge_tool_call(calls: dict[int, dict], delta: dict) -> None:
    """Tool calls stream as fragments keyed by index: the id and name once, the arguments in pieces."""
    call = calls.setdefault(delta.get("index", len(calls)),
                            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    if delta.get("id"):
        call["id"] = delta["id"]
    fn = delta.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] += fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] += fn["arguments"]
