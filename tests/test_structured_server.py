"""Constrained decoding end to end: the official `openai` client against the real server on the tiny
random-weight model, for both tool-call formats. Only the grammar makes such a model write a valid call,
so a schema-valid call with finish_reason "tool_calls" is the proof.

Outputs are kept short on purpose (bounded strings and numbers, thinking off unless tested): every token
of a CPU run costs. EOS gets a logit bias, which only matters where the grammar allows EOS at all (after a
complete call). It cannot stop "required" from chaining calls, though: a token such as `>\n` closes one
call and opens the next in one step, so these tests ask for one call (parallel_tool_calls=false); the
grammar tests cover several.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

import flashnext.tokenizer as tokenizer_pkg
from flashnext.engine.args import DEFAULT_MODEL
from flashnext.engine.loading import resolve_model
from test_server_harness import ServerProcess, shared_server  # noqa: F401  (fixture)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
                   "required": ["utc_offset"]}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]

_servers: dict[str, ServerProcess] = {}


@pytest.fixture(scope="session")
def hermes_server(tmp_path_factory):
    """The tiny model with the hermes (JSON) template: the same weights, another chat template. One process
    for the session, whichever test module asks first (each module that imports a fixture gets its own)."""
    if "hermes" not in _servers:
        folder = tmp_path_factory.mktemp("hermes-model") / "tiny-hermes"
        shutil.copytree(resolve_model(DEFAULT_MODEL), folder)
        shutil.copy(Path(tokenizer_pkg.__file__).parent / "templates" / "hermes.jinja", folder / "chat_template.jinja")
        _servers["hermes"] = ServerProcess("--model", str(folder))
    return _servers["hermes"]


@pytest.fixture(params=["qwen3_coder", "hermes"])
def server(request, shared_server):  # noqa: F811
    return shared_server if request.param == "qwen3_coder" else request.getfixturevalue("hermes_server")


def eos_bias(server: ServerProcess) -> dict:
    with server.client() as c:
        ids = c.post("/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    return {str(ids[0]): 30}


def check_calls(calls: list[tuple[str, str]], allowed: set[str]) -> None:
    assert calls, "no tool call"
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def run_chat(client, model, stream: bool, **kw):
    """(calls as (name, arguments JSON), finish_reason, message content) for choice 0, streamed or not."""
    if not stream:
        r = client.chat.completions.create(model=model, messages=MESSAGES, **kw)
        msg = r.choices[0].message
        return [(c.function.name, c.function.arguments) for c in msg.tool_calls or []], r.choices[0].finish_reason, msg
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kw):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish, None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_are_schema_valid(server, choice, stream):
    client = server.openai()
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    calls, finish, _ = run_chat(client, server.model_id(), stream, tools=TOOLS, tool_choice=tool_choice,
                                max_tokens=200, seed=7, logit_bias=eos_bias(server), parallel_tool_calls=False,
                                extra_body=NO_THINKING)
    assert finish == "tool_calls"
    check_calls(calls, set(SCHEMAS) if choice == "required" else {"get_weather"})
    assert len(calls) == 1


def test_forced_call_after_reasoning(shared_server):  # noqa: F811
    """Thinking on: the prompt opened <think>, so free text comes first, then the call."""
    client = shared_server.openai()
    bias = eos_bias(shared_server)
    with shared_server.client() as c:
        bias[str(c.post("/tokenize", json={"prompt": "</think>"}).json()["tokens"][0])] = 2  # a few dozen tokens
    r = client.chat.completions.create(model=shared_server.model_id(), messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=300, seed=3, logit_bias=bias)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], {"get_time"})
    assert choice.message.model_extra.get("reasoning_content") is not None


def test_json_schema_output_validates(shared_server):  # noqa: F811
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "sure": {"type": "boolean"}, "unit": {"enum": ["m", "s"]}},
              "required": ["answer", "sure", "unit"], "additionalProperties": False}
    client = shared_server.openai()
    r = client.chat.completions.create(
        model=shared_server.model_id(), messages=MESSAGES, max_tokens=120, seed=1, logit_bias=eos_bias(shared_server),
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_output_parses(shared_server):  # noqa: F811
    client = shared_server.openai()
    with shared_server.client() as c:
        quote, brace = (c.post("/tokenize", json={"prompt": s}).json()["tokens"][0] for s in ('"', "}"))
    # Strings and objects close early: a random model left alone writes one string for hundreds of tokens.
    bias = {**eos_bias(shared_server), str(quote): 6, str(brace): 6}
    r = client.chat.completions.create(model=shared_server.model_id(), messages=MESSAGES, max_tokens=200, seed=2,
                                       logit_bias=bias, response_format={"type": "json_object"}, extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_schema_in_completions(shared_server):  # noqa: F811
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    with shared_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "JSON:", "max_tokens": 60, "seed": 0, "logit_bias": eos_bias(shared_server),
                                            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


BAD_REQUESTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    # generating past a constrained output's end failed the engine step of every request running (session 15)
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": TOOLS[0]["function"]["name"]}},
      "min_tokens": 3}, "min_tokens"),
    # past torch.Generator's range (choice i samples with seed + i) it did too
    ({"seed": 2**64}, "seed"),
    ({"seed": 2**64 - 1, "n": 2}, "seed"),
]


@pytest.mark.parametrize("extra,param", BAD_REQUESTS)
def test_invalid_schema_is_400(shared_server, extra, param):  # noqa: F811
    body = {"model": shared_server.model_id(), "messages": MESSAGES, "max_tokens": 5, **extra}
    with shared_server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_invalid_schema_is_400_for_the_openai_client(shared_server):  # noqa: F811
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        shared_server.openai().chat.completions.create(
            model=shared_server.model_id(), messages=MESSAGES, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})
    assert "foo" in str(info.value)
