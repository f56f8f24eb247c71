"""Raw-HTTP contract of the OpenAI server: stream shape, error shape for bad input, auxiliary routes."""
from __future__ import annotations

import json

import httpx
import pytest

from test_server_harness import shared_server  # noqa: F401  (fixture)

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Say hello."}]


def sse_events(response: httpx.Response) -> tuple[list, list[str]]:
    """(data payloads, comment lines) of an SSE response; payloads are dicts or the string '[DONE]'."""
    payloads, comments = [], []
    for line in response.iter_lines():
        if line.startswith(":"):
            comments.append(line)
        elif line.startswith("data: "):
            data = line[len("data: "):]
            payloads.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return payloads, comments


def assert_error_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_chat_stream_shape(shared_server):
    req = {"messages": MSGS, "max_tokens": 8, "ignore_eos": True, "stream": True,
           "stream_options": {"include_usage": True}}
    with shared_server.client() as c, c.stream("POST", CHAT, json=req) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events, _ = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["system_fingerprint"] for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])


def test_completions_stream_shape(shared_server):
    req = {"prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True, "stream": True,
           "stream_options": {"include_usage": True}}
    with shared_server.client() as c, c.stream("POST", "/v1/completions", json=req) as r:
        events, _ = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_without_include_usage_no_usage_chunk(shared_server):
    req = {"messages": MSGS, "max_tokens": 3, "stream": True}
    with shared_server.client() as c, c.stream("POST", CHAT, json=req) as r:
        events, _ = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])
    assert all("usage" not in e or e["usage"] is None for e in events[:-1])


def test_n_streams_every_choice_with_its_own_finish(shared_server):
    req = {"messages": MSGS, "max_tokens": 4, "n": 3, "seed": 7, "stream": True, "ignore_eos": True}
    with shared_server.client() as c, c.stream("POST", CHAT, json=req) as r:
        events, _ = sse_events(r)
    chunks = events[:-1]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(roles) == [0, 1, 2] and sorted(finishes) == [0, 1, 2]


LONG = "x" * 200_000


def post_json(client, path: str, body: dict):
    """The body as JSON with \\u escapes (json.dumps's default: a lone surrogate travels as one, as clients send it)."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize("name, body, status, param", [
    ("missing messages", {"model": None}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("messages not a list", {"messages": "hello"}, 400, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("content wrong type", {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("temperature -1", {"messages": MSGS, "temperature": -1}, 400, "temperature"),
    ("temperature string", {"messages": MSGS, "temperature": "hot"}, 400, "temperature"),
    ("top_p 0", {"messages": MSGS, "top_p": 0}, 400, "top_p"),
    ("n 0", {"messages": MSGS, "n": 0}, 400, "n"),
    ("max_tokens 0", {"messages": MSGS, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens string", {"messages": MSGS, "max_tokens": "many"}, 400, "max_tokens"),
    ("max_tokens beyond context", {"messages": MSGS, "max_tokens": 10_000_000}, 400, "max_tokens"),
    ("top_logprobs 50", {"messages": MSGS, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("logit_bias key not an id", {"messages": MSGS, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("stop wrong type", {"messages": MSGS, "stop": 5}, 400, "stop"),
    ("empty stop string", {"messages": MSGS, "stop": [""]}, 400, "stop"),
    ("tool arguments not JSON", {"messages": MSGS + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, 400, None),
    ("tools wrong type", {"messages": MSGS, "tools": "all"}, 400, "tools"),
    ("tool_choice unknown function", {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
                                      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice"),
    ("unknown model", {"model": "gpt-17", "messages": MSGS}, 404, "model"),
    # were 500s (session 15)
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
    ("text part without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages"),
    ("lone surrogate", {"messages": [{"role": "user", "content": "a\ud800b"}]}, 400, None),
    ("chat_template_kwargs setting a request field", {"messages": MSGS,
                                                      "chat_template_kwargs": {"add_generation_prompt": False}},
     400, "chat_template_kwargs"),
    ("max_completion_tokens 0", {"messages": MSGS, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("top_logprobs without logprobs", {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    ("lone surrogate quoted in the error", {"model": "gpt\ud800", "messages": MSGS}, 404, "model"),
])
def test_invalid_chat_requests_are_4xx_in_openai_shape(shared_server, name, body, status, param):
    with shared_server.client() as c:
        err = assert_error_shape(post_json(c, CHAT, body), status)
        if param is not None:
            assert err["param"] == param, (name, err)
        assert c.get("/health").status_code == 200


def test_prompt_longer_than_context_is_context_length_exceeded(shared_server):
    with shared_server.client() as c:
        max_len = c.get("/v1/models").json()["data"][0]["max_model_len"]
        r = c.post("/v1/completions", json={"prompt": [1] * (max_len + 5), "max_tokens": 1})
        err = assert_error_shape(r, 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": max_len})
        assert assert_error_shape(r, 400)["code"] == "context_length_exceeded"


@pytest.mark.parametrize("name, body, param", [
    ("suffix unsupported", {"prompt": "a", "suffix": "b"}, "suffix"),
    ("echo with logprobs unsupported", {"prompt": "a", "echo": True, "logprobs": 0}, "echo"),  # no prompt logprobs
    ("empty prompt list", {"prompt": []}, "prompt"),
    ("prompt wrong type", {"prompt": {"text": "a"}}, "prompt"),
    ("token id out of vocabulary", {"prompt": [-1, 2]}, "prompt"),
    ("missing prompt", {"max_tokens": 3}, "prompt"),
    ("lone surrogate", {"prompt": "a\udc00"}, None),
])
def test_invalid_completion_requests(shared_server, name, body, param):
    with shared_server.client() as c:
        assert assert_error_shape(post_json(c, "/v1/completions", body), 400)["param"] == param


def test_transport_level_errors(shared_server):
    with shared_server.client() as c:
        r = c.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
        assert assert_error_shape(r, 400)["code"] == "invalid_json"
        assert_error_shape(c.post(CHAT, content=b"[1, 2]"), 400)
        assert_error_shape(c.get("/v1/no-such-route"), 404)
        assert_error_shape(c.get(CHAT), 405)
        big = json.dumps({"messages": [{"role": "user", "content": "x" * (33 << 20)}]}).encode()
        assert_error_shape(c.post(CHAT, content=big), 413)
        assert c.get("/health").status_code == 200


def test_unknown_fields_are_accepted(shared_server):
    req = {"messages": MSGS, "max_tokens": 2, "some_vendor_extra": {"a": 1}, "store": False,
           "metadata": {"k": "v"}, "user": "u1", "parallel_tool_calls": True}
    with shared_server.client() as c:
        assert c.post(CHAT, json=req).status_code == 200


def test_model_accepted_by_served_name(shared_server):
    with shared_server.client() as c:
        model = c.get("/v1/models").json()["data"][0]
        assert {"id", "object", "created", "owned_by", "max_model_len"} <= set(model)
        r = c.post(CHAT, json={"model": model["id"], "messages": MSGS, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == model["id"]


def test_tokenize_and_detokenize_in_vllm_and_llama_cpp_shapes(shared_server):
    with shared_server.client() as c:
        v = c.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert v["count"] == len(v["tokens"]) > 0 and v["max_model_len"] > 0
        assert c.post("/detokenize", json={"tokens": v["tokens"]}).json()["prompt"] == "Hello world"
        l = c.post("/tokenize", json={"content": "Hello world"}).json()
        assert l == {"tokens": v["tokens"]}
        assert c.post("/detokenize", json={"tokens": l["tokens"]}).json()["content"] == "Hello world"
        chat = c.post("/tokenize", json={"messages": MSGS}).json()
        assert chat["count"] > v["count"]
        assert_error_shape(c.post("/tokenize", json={}), 400)
        assert_error_shape(post_json(c, "/tokenize", {"prompt": "a\ud800"}), 400)
        assert_error_shape(c.post("/tokenize", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400)


def test_health_answers_head_too(shared_server):
    with shared_server.client() as c:
        assert c.head("/health").status_code == c.get("/health").status_code == 200


def test_props_and_metrics(shared_server):
    with shared_server.client() as c:
        props = c.get("/props").json()
        assert props["default_generation_settings"]["n_ctx"] > 0
        assert props["total_slots"] >= 1 and "model_path" in props
        c.post(CHAT, json={"messages": MSGS, "max_tokens": 2})
        text = httpx.get(shared_server.base + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 'flashnext_prefix_cache_bytes{model_name=', 'tier="device"'):
        assert name in text, name


def test_completion_text_offsets_point_into_the_text(shared_server):
    """logprobs.text_offset: where each token's text starts in the choice's text — the same streamed and not, never
    decreasing, inside the text (they had counted a skipped special token's or a split character's own decoding)."""
    body = {"prompt": "Once upon", "max_tokens": 40, "temperature": 0, "logprobs": 1}
    with shared_server.client() as c:
        whole = c.post("/v1/completions", json=body).json()["choices"][0]
        offsets, text = [], ""
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    if choices:
                        if choices[0]["logprobs"]:   # a chunk's tokens start in its own text (or at its end)
                            chunk = choices[0]["logprobs"]["text_offset"]
                            assert len(text) <= chunk[0] and chunk[-1] <= len(text) + len(choices[0]["text"])
                            offsets += chunk
                        text += choices[0]["text"]
    assert text == whole["text"] and offsets == whole["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and len(offsets) == 40 and offsets[-1] <= len(text)


def test_completion_text_offsets_start_at_each_tokens_text(shared_server):
    """text[text_offset:] starts with the token's own text, streamed and not, for every token that shows in the text as
    itself (not one byte of a character split over tokens: its own text is U+FFFD). The U+FFFD of an invalid byte,
    held back until the next token proved it invalid, had been counted as that next token's start."""
    body = {"prompt": "Once upon", "max_tokens": 40, "temperature": 0, "logprobs": 1, "skip_special_tokens": False}
    with shared_server.client() as c:
        whole = c.post("/v1/completions", json=body).json()["choices"][0]
        streamed = {"text": "", "tokens": [], "text_offset": []}
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and (choices := json.loads(line[6:])["choices"]):
                    streamed["text"] += choices[0]["text"]
                    if choices[0]["logprobs"]:
                        streamed["tokens"] += choices[0]["logprobs"]["tokens"]
                        streamed["text_offset"] += choices[0]["logprobs"]["text_offset"]
    for text, tokens, offsets in ((whole["text"], whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"]),
                                  (streamed["text"], streamed["tokens"], streamed["text_offset"])):
        whole_tokens = [(t, o) for t, o in zip(tokens, offsets) if "\ufffd" not in t]
        # The tiny model's greedy reply has a whole token right after an invalid byte, or this test proves nothing.
        assert any(o and text[o - 1] == "\ufffd" for _, o in whole_tokens)
        for t, o in whole_tokens:
            assert text[o:].startswith(t), (t, o, text[o:o + len(t) + 2])


def test_a_template_variable_named_like_a_parameter_is_not_a_500(shared_server):
    """chat_template_kwargs reach the template as variables, whatever their names ("template" collided with the
    renderer's own parameter: a TypeError, a 500)."""
    with shared_server.client() as c:
        r = c.post(CHAT, json={"messages": MSGS, "max_tokens": 1, "chat_template_kwargs": {"template": "x"}})
    assert r.status_code == 200, r.text
