"""A 12-turn agent loop through the real server: each turn the model must call a tool (the grammar makes
the random tiny model do it), the client appends the call (arguments as the JSON string it got) and the
tool's result to the history, and sends it all back. Every turn re-renders the whole history, so a
template that cannot take its own calls back fails here, in either tool format."""
from __future__ import annotations

import json

import jsonschema

from test_server_harness import shared_server  # noqa: F401  (fixture)
from test_structured_server import NO_THINKING, WEATHER, eos_bias, hermes_server, server  # noqa: F401

STEP = {"type": "function", "function": {
    "name": "step", "description": "Advance the counter.",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["n"], "additionalProperties": False}}}
SCHEMAS = {"step": STEP["function"]["parameters"], "get_weather": WEATHER["function"]["parameters"]}
TURNS = 12


def test_twelve_turn_tool_loop(server):  # noqa: F811
    client, model, bias = server.openai(), server.model_id(), eos_bias(server)
    messages = [{"role": "system", "content": "You drive a counter with tools."},
                {"role": "user", "content": "Count to twelve, one step per call."}]
    for turn in range(TURNS):
        # Mostly the named tool (short calls); every fourth turn "required" over both tools.
        choice = "required" if turn % 4 == 3 else {"type": "function", "function": {"name": "step"}}
        r = client.chat.completions.create(model=model, messages=messages, tools=[STEP, WEATHER], tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=200, seed=turn, logit_bias=bias,
                                           extra_body=NO_THINKING)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", (turn, message)
        call = message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        messages.append({"role": "assistant", "content": message.content or "",
                         "tool_calls": [{"id": call.id, "type": "function",
                                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"turn": turn, "ok": True})})
    assert r.usage.prompt_tokens > 12 * 20   # the whole history went back each time
