"""The OpenAI request bodies we accept, as pydantic models.

Every model allows unknown fields (harnesses send vendor extras; we log them once and go on). Checks here
are about shape; ranges live in `SamplingParams` so the server and the Python API say the same thing.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


log = logging.getLogger("flashnext.server")
_reported: set[tuple[str, str]] = set()


def log_unknown_fields(endpoint: str, body: BaseModel) -> None:
    """Says once per field that we accepted and ignored it: harnesses keep inventing extras."""
    for name in body.model_extra or {}:
        if (endpoint, name) not in _reported:
            _reported.add((endpoint, name))
            log.info("%s: ignoring unknown request field '%s'", endpoint, name)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value):
        if isinstance(value, str):
            try:
                decoded = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"function arguments must be a JSON string, could not decode it: {exc.msg}") from None
            if not isinstance(decoded, dict):
                raise ValueError("function arguments must encode a JSON object")
        return value


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: dict[str, str]


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None   # {"name", "schema", "strict"}; checked when the grammar is built


class _SamplingFields(_Open):
    """Fields shared by chat and completions; the extra (non-OpenAI) ones follow vLLM's names."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(union_mode="left_to_right")
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None   # vLLM's extra: JSON output for raw prompts too

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("prompt must not be empty")
        return value


class TokenizeRequest(_Open):
    """vLLM's shapes ({"prompt"} or {"messages"}) and llama.cpp's ({"content"})."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    with_pieces: bool = False


class DetokenizeRequest(_Open):
    model: str | None = None
    tokens: list[int]
