"""Chat rendering: parity with transformers' apply_chat_template for both Qwen templates, message
normalisation, and errors a client can cause."""

import copy
import json

import pytest

from flashnext.tokenizer import ChatTemplateError, Tokenizer, render_chat
from flashnext.tokenizer.chat_template import normalize_messages
from flashnext.tokenizer.synthetic import write_tokenizer_files

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city <b>now</b> & later — über",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}


def call(name, arguments, call_id="call_1"):
    # OpenAI wire format: arguments are a JSON string.
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


ARGS = {"city": "Tōkyō", "days": 3, "opts": {"metric": True, "extra": None}, "tags": ["a", "b"], "flag": False}

# (name, messages, tools)
CONVERSATIONS = [
    ("user", [{"role": "user", "content": "Hi!"}], None),
    ("system", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    ("multi_turn", [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ], None),
    ("tools_only", [{"role": "user", "content": "Weather in Paris?"}], [WEATHER, SEARCH]),
    ("tools_system", [
        {"role": "system", "content": "  Use tools.  "},
        {"role": "user", "content": "Weather in Paris?"},
    ], [WEATHER]),
    ("tool_loop", [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Tokyo and Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two cities, two calls.",
         "tool_calls": [call("get_weather", ARGS), call("get_weather", {"city": "Paris"}, "call_2")]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "Let me also search.", "reasoning_content": "Need more.",
         "tool_calls": [call("search", {"q": "tokyo <events> & more"})]},
        {"role": "tool", "content": "nothing found"},
    ], [WEATHER, SEARCH]),
    ("tool_loop_answered", [
        {"role": "user", "content": "Weather in Tokyo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call("get_weather", {"city": "Tokyo"})]},
        {"role": "tool", "content": "18C"},
        {"role": "assistant", "content": "It is 18C.", "reasoning_content": "The tool said 18C."},
        {"role": "user", "content": "Thanks! And tomorrow?"},
    ], [WEATHER]),
    ("think_in_content", [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreeting.\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "<think>\nFarewell.\n</think>\n\nGoodbye!"},
    ], None),
    ("reasoning_latest_turn", [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "\nThey greet me.\n"},
    ], None),
    ("unicode", [{"role": "user", "content": "你好 😀 — naïve café"}], [WEATHER]),
]

KWARGS = [dict(), dict(enable_thinking=False), dict(enable_thinking=True), dict(add_generation_prompt=False)]


def hf_form(messages):
    """What transformers gets: the same conversation with arguments already decoded (its templates
    would print a JSON string verbatim instead of re-serialising it)."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for tool_call in message.get("tool_calls", []):
            tool_call["function"]["arguments"] = json.loads(tool_call["function"]["arguments"])
    return messages


@pytest.fixture(scope="module", params=["qwen3_coder", "hermes"])
def folder(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    write_tokenizer_files(out, vocab_size=512, tool_format=request.param)
    return out, request.param


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder[0]))


@pytest.mark.parametrize("kwargs", KWARGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
@pytest.mark.parametrize("name, messages, tools", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_matches_transformers(folder, hf_tokenizer, name, messages, tools, kwargs):
    tok = Tokenizer.from_dir(folder[0])
    kwargs = {"add_generation_prompt": True, **kwargs}
    ours = tok.apply_chat_template(copy.deepcopy(messages), tools=tools, **kwargs)
    theirs = hf_tokenizer.apply_chat_template(hf_form(messages), tools=tools, tokenize=False, **kwargs)
    assert ours == theirs
    ids = hf_tokenizer.apply_chat_template(hf_form(messages), tools=tools, tokenize=True, **kwargs)["input_ids"]
    assert tok.encode(ours) == ids


def test_rendered_formats(folder):
    tok = Tokenizer.from_dir(folder[0])
    assert tok.tool_format == folder[1]
    text = tok.apply_chat_template(CONVERSATIONS[5][1], tools=[WEATHER, SEARCH])
    assert '"description": "Get the weather for a city <b>now</b> & later — über"' in text  # transformers' tojson
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 18}\n</tool_response>\n<tool_response>\n{\"temp\": 21}\n" \
           "</tool_response><|im_end|>" in text  # consecutive tool results share one user turn
    assert "<think>\nTwo cities, two calls.\n</think>\n\n" in text  # reasoning after the last query is kept
    if folder[1] == "qwen3_coder":
        assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nTōkyō\n</parameter>\n<parameter=days>\n3\n"
                "</parameter>\n<parameter=opts>\n{\"metric\": true, \"extra\": null}\n</parameter>\n") in text
        assert text.endswith("<|im_start|>assistant\n<think>\n")
    else:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō", "days": 3,' in text
        assert text.endswith("<|im_start|>assistant\n")
    off = tok.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Reasoning of turns before the last user query is dropped.
    history = tok.apply_chat_template(CONVERSATIONS[6][1], tools=[WEATHER])
    assert "The tool said 18C." not in history and "It is 18C." in history


def test_normalisation():
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Rule one."}, {"type": "text", "text": "Two."}]},
        {"role": "user", "content": "Hi", "name": None},
        {"role": "assistant", "content": None, "reasoning": "think",
         "tool_calls": [call("f", {"a": [1, {"b": "ü"}]}), {"function": {"name": "g", "arguments": " "}}]},
    ]
    out = normalize_messages(messages)
    assert out[0] == {"role": "system", "content": "Rule one.\nTwo."}
    assert out[1] == {"role": "user", "content": "Hi"}
    assert "content" not in out[2] and out[2]["reasoning_content"] == "think"
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"a": [1, {"b": "ü"}]}
    assert out[2]["tool_calls"][1]["function"]["arguments"] == {}
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"a": [1, {"b": "\\u00fc"}]}'  # caller's untouched


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}],
         r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}],
         r"messages\[0\].*must be a JSON object"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         r"messages\[0\]\.content: only text parts"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string"),
        (["hello"], r"messages\[0\] must be an object"),
    ],
)
def test_client_errors_are_value_errors(messages, message):
    with pytest.raises(ValueError, match=message):
        render_chat("{{ messages }}", messages)


def test_template_errors(folder):
    tok = Tokenizer.from_dir(folder[0])
    if folder[1] == "qwen3_coder":
        with pytest.raises(ChatTemplateError, match="No user query found"):
            tok.apply_chat_template([{"role": "system", "content": "only a system prompt"}])
        with pytest.raises(ChatTemplateError, match="System message must be at the beginning"):
            tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ raise_exception('nope') }}", [])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% if %}", [])
    with pytest.raises(ChatTemplateError):  # the sandbox blocks attribute tricks
        render_chat("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])


def test_environment_features():
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}|"
        "{{ tools | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}|{% generation %}g{% endgeneration %}|"
        "{{ flag }}"
    )
    out = render_chat(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                      tools=[{"x": "<é>"}], flag=7)
    assert out == 'a|[\n  {\n    "x": "<é>"\n  }\n]|4|g|7'


def test_template_sources(tmp_path):
    write_tokenizer_files(tmp_path, vocab_size=512, tool_format="hermes")
    template = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [486, 488]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == template and tok.tool_format == "hermes"
    assert tok.eos_token_ids == {486, 488}
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).chat_template == template
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
