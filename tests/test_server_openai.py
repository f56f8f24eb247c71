"""The official `openai` client against the real server: what agent harnesses do, unmodified."""
from __future__ import annotations

import openai
import pytest

from test_server_harness import shared_server  # noqa: F401  (fixture)

MSGS = [{"role": "user", "content": "Write one word."}]


@pytest.fixture(scope="module")
def client(shared_server):
    return shared_server.openai()


@pytest.fixture(scope="module")
def model(shared_server):
    return shared_server.model_id()


def test_models_list(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]


def test_chat(client, model):
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=6, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_with_usage(client, model):
    stream = client.chat.completions.create(model=model, messages=MSGS, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_repeated_prompt_reports_cached_tokens(client, model):
    msgs = [{"role": "system", "content": "You are terse. " * 8}, *MSGS]
    first = client.chat.completions.create(model=model, messages=msgs, max_tokens=2)
    again = client.chat.completions.create(model=model, messages=msgs, max_tokens=2)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert 0 <= again.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens


def test_next_turn_reuses_the_whole_history(client, model, shared_server):
    # The template renders a past reply without the think block the generation prompt opened, so the next
    # turn shares the first prompt up to its generation prompt and no further: the engine snapshots there.
    history = [{"role": "system", "content": "You answer in riddles. " * 6}, {"role": "user", "content": "A colour?"}]
    client.chat.completions.create(model=model, messages=history, max_tokens=3, extra_body={"ignore_eos": True})
    next_turn = history + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one."}]
    again = client.chat.completions.create(model=model, messages=next_turn, max_tokens=2)
    with shared_server.client() as c:
        shared = c.post("/tokenize", json={"messages": history, "add_generation_prompt": False}).json()["count"]
    assert again.usage.prompt_tokens_details.cached_tokens == shared


def test_chat_n_greater_than_one(client, model):
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, n=3, seed=1,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 12


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.token, str) and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def test_chat_stream_logprobs(client, model):
    stream = client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, logprobs=True,
                                            top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 4


def test_greedy_is_deterministic(client, model):
    texts = {client.chat.completions.create(model=model, messages=MSGS, max_tokens=8, temperature=0)
             .choices[0].message.content for _ in range(2)}
    assert len(texts) == 1


def test_chat_with_tools_and_thinking_off(client, model):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    r = client.chat.completions.create(model=model, messages=MSGS, tools=tools, max_tokens=8,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    if r.choices[0].finish_reason == "tool_calls":
        assert r.choices[0].message.tool_calls


def test_completions(client, model):
    r = client.completions.create(model=model, prompt="The sky is", max_tokens=5, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_completions_batch_n_echo_and_logprobs(client, model):
    r = client.completions.create(model=model, prompt=["a b", "c d"], n=2, max_tokens=3, echo=True,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("a b") and r.choices[2].text.startswith("c d")
    r = client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=3, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3


def test_completions_stream(client, model):
    chunks = list(client.completions.create(model=model, prompt="Hi", max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_errors_raise_typed_exceptions(client, model):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MSGS, temperature=-1)
    assert info.value.body["param"] == "temperature"
