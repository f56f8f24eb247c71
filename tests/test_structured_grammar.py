"""The grammar builder and the xgrammar backend, token by token on the synthetic Qwen tokenizer.

A hand-written call in the template's exact format must pass the matcher token by token and then allow
only EOS; a call that breaks the schema or the format must be rejected at the token where it goes wrong.
"""
from __future__ import annotations

import json

import pytest
import torch

from flashnext.engine.sampling_params import InvalidParams
from flashnext.engine.structured import Reasoning, json_output, tool_calls
from flashnext.engine.structured import openai as structured
from flashnext.engine.structured.backend import GrammarBackend, apply_constraints
from flashnext.tokenizer import Tokenizer
from flashnext.tokenizer.synthetic import write_tokenizer_files

MODEL_VOCAB = 520  # the model's embedding is padded past the tokenizer's 512 ids

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                   "unit": {"enum": ["c", "f"]}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city", "days"]}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOOP]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(folder, vocab_size=512)
    return folder


@pytest.fixture(scope="module")
def setup(folder):
    tok = Tokenizer.from_dir(folder)
    return tok, GrammarBackend(folder / "tokenizer.json", MODEL_VOCAB, tok.eos_token_ids)


IM_END = "<|im_end|>"


def feed(setup, spec, text: str) -> str:
    """'complete' if text then EOS passes; 'open' if text passes but EOS may not follow yet; else where it failed."""
    tok, backend = setup
    constraint = backend.constraint(spec)
    ids = tok.encode(text)
    for i, token in enumerate(ids):
        if not constraint.accept(token):
            return f"rejected after {tok.decode(ids[:i])!r}"
    eos = tok.token_to_id(IM_END)
    bitmask = torch.zeros(1, (MODEL_VOCAB + 31) // 32, dtype=torch.int32)
    constraint.fill(bitmask, 0)
    if not constraint.accept(eos):
        return "open"
    assert constraint.complete
    return "complete"


def xml_call(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def hermes_call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


XML_CASES = [
    # (text, expected) with thinking off
    (xml_call("get_weather", city="Paris", days=3), "complete"),
    (xml_call("get_weather", city="New\nYork", days=14, unit="f", tags='["a", "b"]'), "complete"),
    (xml_call("get_weather", city="Paris", days=3) + "\n" + xml_call("noop"), "complete"),
    (xml_call("get_weather", city="Paris", days=3) + "\n", "open"),
    (xml_call("get_weather", city="Paris", days=30), "rejected after '<tool_call>\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n<parameter=days>\\n3'"),
    (xml_call("get_weather", days=3), "rejected"),                     # a required parameter missing
    (xml_call("get_weather", city="Paris", days=3, extra=1), "rejected"),  # not in the schema
    (xml_call("get_weather", city="Paris", days=3, unit="k"), "rejected"),
    (xml_call("get_weather", city="a very long city name", days=3), "rejected"),  # maxLength
    (xml_call("get_weather", days=3, city="Paris"), "rejected"),       # declared order
    (xml_call("get_time"), "rejected"),                                 # not a listed tool
    ("Sure! " + xml_call("noop"), "rejected"),                          # no free text before the call
    (xml_call("noop").replace("\n<function", "<function"), "rejected"),  # the template's exact whitespace
    ("", "open"),
]


@pytest.mark.parametrize("text,expected", XML_CASES)
def test_qwen3_coder_calls(setup, text, expected):
    got = feed(setup, tool_calls(TOOLS, "qwen3_coder"), text)
    assert got.startswith(expected), got


HERMES_CASES = [
    (hermes_call("get_weather", {"city": "Paris", "days": 3}), "complete"),
    (hermes_call("get_weather", {"city": "Paris", "days": 3, "unit": "c", "tags": []}) + "\n" + hermes_call("noop", {}),
     "complete"),
    (hermes_call("get_weather", {"city": "Paris", "days": 0}), "rejected"),
    (hermes_call("get_weather", {"city": "Paris"}), "rejected"),
    (hermes_call("get_weather", {"days": 3, "city": "Paris"}), "rejected"),   # declared order, as xgrammar keeps it
    (hermes_call("get_weather", {"city": "Paris", "days": "3"}), "rejected"),
    (hermes_call("nope", {}), "rejected"),
    # A raw control character is not JSON, however short the string (xgrammar lets it into bounded strings).
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a\x0fb", "days": 3}}\n</tool_call>', "rejected"),
    (hermes_call("noop", {}).replace('{"name"', '{ "name"'), "rejected"),
]


@pytest.mark.parametrize("text,expected", HERMES_CASES)
def test_hermes_calls(setup, text, expected):
    got = feed(setup, tool_calls(TOOLS, "hermes"), text)
    assert got.startswith(expected), got


def test_one_call_when_not_parallel_and_for_a_named_tool(setup):
    one = tool_calls(TOOLS, "qwen3_coder", parallel=False)
    assert feed(setup, one, xml_call("noop")) == "complete"
    assert feed(setup, one, xml_call("noop") + "\n").startswith("rejected")
    named = structured.from_tool_choice([NOOP], {"type": "function", "function": {"name": "noop"}}, "hermes")
    assert feed(setup, named, hermes_call("noop", {})) == "complete"
    assert feed(setup, named, hermes_call("get_weather", {"city": "P", "days": 1})).startswith("rejected")


@pytest.mark.parametrize("fmt,call", [("qwen3_coder", xml_call("noop")), ("hermes", hermes_call("noop", {}))])
def test_reasoning_comes_first(setup, fmt, call):
    opened = tool_calls(TOOLS, fmt, reasoning=Reasoning.OPEN)
    assert feed(setup, opened, "\nLet me think: <tool_call> is next.\n</think>\n\n" + call) == "complete"
    assert feed(setup, opened, call) == "open"            # inside reasoning the call is just text
    assert feed(setup, opened, "x</think>\n" + call).startswith("rejected")
    optional = tool_calls(TOOLS, fmt, reasoning=Reasoning.OPTIONAL)
    assert feed(setup, optional, call) == "complete"
    assert feed(setup, optional, "<think>\nhmm\n</think>\n\n" + call) == "complete"


def test_json_object_and_schema(setup):
    assert feed(setup, json_output(None), '{"a": [1, {"b": null}], "c": "d"}') == "complete"
    assert feed(setup, json_output(None), '[1]').startswith("rejected")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    assert feed(setup, json_output(schema), '{"n": 5, "ok": true}') == "complete"
    assert feed(setup, json_output(schema), '{"n": 5}').startswith("rejected")
    assert feed(setup, json_output(schema, Reasoning.OPEN), 'so</think>\n\n{"n": 5, "ok": false}') == "complete"


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/missing"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_schema"},
])
def test_invalid_response_format_names_the_field(response_format):
    with pytest.raises(InvalidParams) as info:
        structured.from_response_format(response_format)
    assert info.value.param == "response_format"


def test_invalid_tool_schema_names_tools():
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}
    with pytest.raises(InvalidParams) as info:
        structured.from_tool_choice([bad], "required", "hermes")
    assert info.value.param == "tools"
    assert structured.from_tool_choice([bad], "auto", "hermes") is None


def test_mask_forbids_special_and_padded_ids(setup):
    tok, backend = setup
    spec = json_output(None, Reasoning.OPEN)   # free text first: the widest mask
    rows = [backend.constraint(spec), None]
    logits = torch.zeros(2, MODEL_VOCAB)
    apply_constraints(logits, rows)
    allowed = torch.isfinite(logits[0])
    assert torch.isfinite(logits[1]).all()     # an unconstrained row is untouched
    assert not allowed[512:].any()             # ids the tokenizer never makes
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert not allowed[tok.token_to_id(name)], name
    assert allowed[tok.token_to_id("</think>")] and allowed[tok.encode("a")[0]]


def test_vocabulary_matches_xgrammars_huggingface_reading(setup, folder):
    """Our tokenizer.json reading decodes every token as xgrammar's transformers path does, except the
    special tokens, which we blank on purpose (never generated under a constraint, save the stop tokens)."""
    transformers = pytest.importorskip("transformers")
    import xgrammar as xgr

    tok, backend = setup
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    theirs = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=MODEL_VOCAB, stop_token_ids=sorted(tok.eos_token_ids))
    ours = backend.info.decoded_vocab
    differ = {i for i, (a, b) in enumerate(zip(theirs.decoded_vocab, ours)) if a != b}
    assert differ == {i for i in range(512) if tok.is_special(i) and i not in tok.eos_token_ids}
    assert all(ours[i] == b"" for i in differ)


def test_sampling_params_refuse_generating_past_a_constraint():
    """ignore_eos or min_tokens beside a constrained output: refused however the constraint is set (the constructor,
    replace(), constrain()), since generating past the grammar's end failed the engine step of every request."""
    from dataclasses import replace

    from flashnext.engine.sampling_params import InvalidParams, SamplingParams
    from flashnext.engine.structured.grammars import json_output

    spec = json_output(None)
    for bad in (dict(ignore_eos=True), dict(min_tokens=3)):
        with pytest.raises(InvalidParams):
            SamplingParams(structured=spec, **bad)
        with pytest.raises(InvalidParams):
            replace(SamplingParams(**bad), structured=spec)
        with pytest.raises(InvalidParams):
            SamplingParams(**bad).constrain(spec)
    assert SamplingParams(structured=spec).structured is spec
