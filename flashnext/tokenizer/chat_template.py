"""Render Hugging Face chat templates the way transformers' apply_chat_template does.

Same sandboxed jinja2 environment, globals and tojson filter, so a model's own template renders
byte-identically; before rendering, OpenAI-style messages are normalised into the plain shape
Qwen's templates expect (string content, system role, tool-call arguments as mappings).
"""

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed on it; a client error."""


# Names a message's reasoning may arrive under; templates read `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def render_chat(template: str, messages, /, tools=None, add_generation_prompt: bool = True, **template_kwargs) -> str:
    """Render `messages` (OpenAI chat format) with `template`; extra kwargs (enable_thinking, …) go to it."""
    try:
        messages = normalize_messages(messages)
    except ValueError as e:   # a message of a shape no template takes (non-text parts, …): the user's to fix
        raise ChatTemplateError(str(e)) from e
    if tools is not None:
        tools = [_plain(tool) for tool in tools]
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
    except (TypeError, AttributeError, KeyError, IndexError) as e:
        # A message of an unexpected shape (e.g. a None where the template concatenates strings).
        raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e


def normalize_messages(messages) -> list[dict]:
    """Plain dicts with None-valued keys dropped (as transformers does), text content joined,
    role developer -> system, reasoning aliases -> reasoning_content, and tool-call arguments
    given as JSON strings decoded into mappings. User mistakes raise ValueError naming the message."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        message = _plain(message)
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
        message = {key: value for key, value in message.items() if value is not None}
        if message.get("role") == "developer":
            message["role"] = "system"
        if "content" in message:
            message["content"] = _join_text(message["content"], i)
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message["reasoning_content"] = _join_text(reasoning, i)
        if "tool_calls" in message:
            message["tool_calls"] = _decode_tool_calls(message["tool_calls"], i)
        out.append(message)
    return out


def _join_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"messages[{i}].content: only text parts are supported, got {kind!r}")
        # vLLM's convention for string-content templates: one part per line.
        return "\n".join(texts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}")


def _decode_tool_calls(tool_calls, i: int) -> list:
    if not isinstance(tool_calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    decoded = []
    for j, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"messages[{i}].tool_calls[{j}] must be an object")
        call = {key: value for key, value in call.items() if value is not None}
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            function = dict(function)
            text = function["arguments"]
            try:
                arguments = json.loads(text) if text.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON ({e.msg} at "
                    f"position {e.pos}): {text[:200]!r}"
                ) from None
            if not isinstance(arguments, dict):
                raise ValueError(
                    f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object, "
                    f"got {type(arguments).__name__}"
                )
            function["arguments"] = arguments
            call["function"] = function
        decoded.append(call)
    return decoded


def _plain(value):
    """Pydantic models (e.g. the openai client's message objects) and tuples -> plain JSON types."""
    if callable(getattr(value, "model_dump", None)):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes <, >, & and ' — transformers replaces it with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e} (line {e.lineno})") from e
