"""Tool calls of both Qwen formats from recorded-style generations: what the client ends up with."""
import json
import re

import pytest

from flashnext.server.parsers import (ChatOutputParser, ToolSchemas, coerce_parameter, detect_tool_format,
                                      get_tool_parser)
from flashnext.server.parsers.hermes import HermesCallScanner
from flashnext.server.parsers.qwen3_coder import Qwen3CoderCallScanner

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "required": ["path", "content"],
        "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                       "overwrite": {"type": "boolean"}, "mode": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "run_shell", "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout_s": {"type": "number"},
                       "env": {"type": "object"}, "args": {"type": "array", "items": {"type": "string"}},
                       "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}},
]
ID = re.compile(r"^call_[A-Za-z0-9]{24}$")


def parse(fmt, text, **kw):
    return ChatOutputParser(fmt, TOOLS, **kw).parse(text)


def calls(msg):
    return [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]


CODE = 'def window(xs, n):\n    """Runs of n items — «inclusive»."""\n    for i in range(len(xs) - n + 1):\n' \
       '        yield xs[i:i + n]\n\n'


def test_hermes_three_calls_nested_unicode():
    text = ("Let me do all three.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3, "unit": "celsius"}}\n'
            "</tool_call>\n<tool_call>\n"
            + json.dumps({"name": "write_file", "arguments": {"path": "src/東京.py", "content": CODE,
                                                               "overwrite": False, "mode": None}})
            + "\n</tool_call>\n<tool_call>\n"
            '{"name": "run_shell", "arguments": {"command": "pytest -q", "timeout_s": 1.5e2, '
            '"env": {"A": {"b": [1, 2.5, true, null]}}, "args": []}}\n</tool_call>')
    msg = parse("hermes", text)
    assert msg.content == "Let me do all three.\n" and msg.reasoning is None
    assert calls(msg) == [
        ("get_weather", {"city": "Zürich", "days": 3, "unit": "celsius"}),
        ("write_file", {"path": "src/東京.py", "content": CODE, "overwrite": False, "mode": None}),
        ("run_shell", {"command": "pytest -q", "timeout_s": 150.0, "env": {"A": {"b": [1, 2.5, True, None]}},
                       "args": []}),
    ]
    assert msg.tool_calls[0].arguments == '{"city": "Zürich", "days": 3, "unit": "celsius"}'  # not \u-escaped
    assert all(ID.match(c.id) and c.type == "function" for c in msg.tool_calls)
    assert len({c.id for c in msg.tool_calls}) == 3


def test_qwen3_coder_values_typed_by_schema():
    text = ("I'll write the file, then run the tests.\n\n<tool_call>\n<function=write_file>\n"
            f"<parameter=path>\nsrc/utils.py\n</parameter>\n<parameter=content>\n{CODE}\n</parameter>\n"
            "<parameter=overwrite>\nTrue\n</parameter>\n<parameter=mode>\n420\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=run_shell>\n"
            '<parameter=command>\npytest -q -k "window and not slow"\n</parameter>\n'
            "<parameter=timeout_s>\n120\n</parameter>\n"
            "<parameter=env>\n{'PYTHONHASHSEED': '0', 'LANG': 'C.UTF-8'}\n</parameter>\n"
            '<parameter=args>\n["-x", "--tb=short"]\n</parameter>\n'
            "<parameter=note>\nnull\n</parameter>\n"
            "</function>\n</tool_call>")
    msg = parse("qwen3_coder", text)
    assert msg.content == "I'll write the file, then run the tests.\n\n"
    assert calls(msg) == [
        ("write_file", {"path": "src/utils.py", "content": CODE, "overwrite": True, "mode": 420}),
        ("run_shell", {"command": 'pytest -q -k "window and not slow"', "timeout_s": 120,
                       "env": {"PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}, "args": ["-x", "--tb=short"],
                       "note": None}),
    ]


@pytest.mark.parametrize("raw,schema,value", [
    ("\n007\n", {"type": "string"}, "007"),                      # a string stays a string
    ("\n  indented\n\n", {"type": "string"}, "  indented\n"),     # exactly one newline each side
    ("line", {"type": "string"}, "line"),                         # no framing newlines to strip
    ("\n42\n", {"type": "integer"}, 42),
    ("\n42.0\n", {"type": "integer"}, 42),
    ("\n-3.25\n", {"type": "number"}, -3.25),
    ("\nfalse\n", {"type": "boolean"}, False),
    ("\nFalse\n", {"type": "boolean"}, False),
    ("\nnull\n", {"type": "null"}, None),
    ("\nNone\n", {"type": ["integer", "null"]}, None),
    ("\nnull\n", {"type": ["string", "null"]}, None),
    ('\n{"a": [1, {"b": "ü"}]}\n', {"type": "object"}, {"a": [1, {"b": "ü"}]}),
    ("\n(1, 'x')\n", {"type": "array"}, [1, "x"]),
    ("\nsoon\n", {"type": "integer"}, "soon"),                    # the tool reports it, we do not guess
    ("\nNaN\n", {"type": "number"}, "NaN"),                       # not strict JSON: kept as text
    ("\n1e400\n", {"type": "number"}, "1e400"),
    ("\n{1, 2}\n", {"type": "array"}, "{1, 2}"),                  # a Python set is not JSON
    # no type, or not in the schema: the text, as vLLM's qwen3_coder parser gives it, whatever it looks like
    ("\n12\n", None, "12"),
    ("\nhello\n", None, "hello"),
    ('\n{"a": 1}\n', {}, '{"a": 1}'),
    ("\n[1, 2]\n", {"description": "any JSON"}, "[1, 2]"),
    ("\nnull\n", None, "null"),
    ("\nTrue\n", {}, "True"),
    ("\n7\n", {"enum": [7, 8]}, "7"),
    ("\ncelsius\n", {"enum": ["celsius", "kelvin"]}, "celsius"),
    ("\n5\n", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 5),
    # a literal of another type than declared stays text (session 15's bug hunt: "1,000" had become [1, 0])
    ("\n1,000\n", {"type": "integer"}, "1,000"),
    ("\n[1, 2]\n", {"type": "integer"}, "[1, 2]"),
    ("\ntrue\n", {"type": "integer"}, "true"),
    ("\n3\n", {"type": "number"}, 3),
    ("\n5\n", {"type": "int"}, 5),                               # not a JSON schema type name: what parses
    ("\nnull\n", {"type": "object"}, None),                      # an optional parameter left out
])
def test_coerce_parameter(raw, schema, value):
    assert coerce_parameter(raw, schema) == value
    assert type(coerce_parameter(raw, schema)) is type(value)


def test_parameter_without_a_type_is_a_string_as_in_vllm():
    """vLLM's qwen3_coder parser returns a parameter the tool's schema does not list, or lists without a
    `type`, as the raw string; it had been parsed as JSON here (47.37 a number, [1, 2] a list)."""
    tools = [*TOOLS, {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"data": {"description": "anything"}, "n": {"type": "integer"}}}}}]
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n"
            "<parameter=lat>\n47.37\n</parameter>\n<parameter=hint>\nnear the lake\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=note>\n<parameter=data>\n{\"a\": 1}\n</parameter>\n"
            "<parameter=n>\n3\n</parameter>\n<parameter=extra>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")
    msg = ChatOutputParser("qwen3_coder", tools).parse(text)
    assert calls(msg) == [("get_weather", {"city": "12", "lat": "47.37", "hint": "near the lake"}),
                          ("note", {"data": '{"a": 1}', "n": 3, "extra": "[1, 2]"})]


MALFORMED = [
    # (format, text, content, calls)
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
    ("hermes", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {'city': 'Paris'}}\n</tool_call>",
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {'city': 'Paris'}}\n</tool_call>", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call> ok',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call> ok', []),
    ("hermes", '<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c"}}\n</tool_call>',
     '<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c"}}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {}} and more\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {}} and more\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Oslo"}}\n</tool_call>',
     '<tool_call>\n{"arguments": {"city": "Oslo"}}\n</tool_call>', []),
    ("hermes", "Wrap calls in <tool_call> tags, like <tool_call>this</tool_call>.",
     "Wrap calls in <tool_call> tags, like <tool_call>this</tool_call>.", []),
    # nested and duplicate tags: the outer opener is text, the well-formed inner call is a call
    ("hermes", '<tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
               "</tool_call>\n</tool_call>",
     "<tool_call>\n</tool_call>", [("get_weather", {"city": "Oslo"})]),
    # missing required parameter: still a call, the tool tells the agent
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2}}\n</tool_call>',
     None, [("get_weather", {"days": 2})]),
    # OpenAI wire shape (arguments as a JSON string) and a no-argument call
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>'
               '<tool_call>{"name": "get_weather"}</tool_call>',
     None, [("get_weather", {"city": "Rome"}), ("get_weather", {})]),
    ("qwen3_coder", "Now:\n<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n"
                    "<parameter=content>\nhalf a fi",
     "Now:\n<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n"
     "<parameter=content>\nhalf a fi", []),
    ("qwen3_coder", "<tool_call>\n<function=delete_everything>\n</function>\n</tool_call>",
     "<tool_call>\n<function=delete_everything>\n</function>\n</tool_call>", []),
    ("qwen3_coder", "<tool_call> is the tag I would use.", "<tool_call> is the tag I would use.", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\ncity=Paris\n</function>\n</tool_call>",
     "<tool_call>\n<function=get_weather>\ncity=Paris\n</function>\n</tool_call>", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
     None, [("get_weather", {"city": "Paris"})]),  # a missing </function> is forgiven
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
     None, [("get_weather", {})]),
    ("qwen3_coder", "<tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n"
                    "</function>\n</tool_call></tool_call>",
     "<tool_call>\n</tool_call>", [("get_weather", {"city": "Lima"})]),
    # a value may hold the closing tags of the format
    ("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=path>\nNOTES.md\n</parameter>\n"
                    "<parameter=content>\nEnd a call with </tool_call> and </function>.\n</parameter>\n"
                    "</function>\n</tool_call>",
     None, [("write_file", {"path": "NOTES.md", "content": "End a call with </tool_call> and </function>."})]),
]


@pytest.mark.parametrize("fmt,text,content,expected", MALFORMED)
def test_malformed_degrades_to_content(fmt, text, content, expected):
    parser = ChatOutputParser(fmt, TOOLS)
    msg = parser.parse(text)
    assert msg.content == content
    assert calls(msg) == expected
    assert parser.has_tool_calls == bool(expected)


def test_no_tools_means_no_calls():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for fmt, tools in (("hermes", []), ("hermes", None), (None, TOOLS)):
        parser = ChatOutputParser(fmt, tools, reasoning=False)
        assert parser.parse(text).content == text and not parser.has_tool_calls


def test_tools_as_pydantic_models():
    pydantic = pytest.importorskip("pydantic")

    class Function(pydantic.BaseModel):
        name: str
        parameters: dict | None = None

    class Tool(pydantic.BaseModel):
        type: str = "function"
        function: Function

    parameters = {"properties": {"n": {"type": "integer"}}}
    schemas = ToolSchemas([Tool(function=Function(name="f", parameters=parameters))])
    assert "f" in schemas and schemas.parameter_schema("f", "n") == {"type": "integer"}


def test_registry():
    assert get_tool_parser("hermes") is HermesCallScanner
    assert get_tool_parser("qwen3_coder") is Qwen3CoderCallScanner
    with pytest.raises(ValueError, match="qwen3_coder"):
        get_tool_parser("mistral")
    coder_template = "{%- for tool in tools %}...<tool_call>\n<function=example_function_name>\n..."
    hermes_template = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    assert detect_tool_format(coder_template) == "qwen3_coder"
    assert detect_tool_format(hermes_template) == "hermes"


def test_unknown_format_is_refused_even_without_tools():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ChatOutputParser("llama3_json", [])


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>\n{"name": "run_shell", "arguments": {"command": "echo \\ud83d"}}\n</tool_call>'),
    ("qwen3_coder", '<tool_call>\n<function=run_shell>\n<parameter=env>\n{"a": "\\udc00"}\n</parameter>\n'
                    '</function>\n</tool_call>'),
])
def test_a_lone_surrogate_escape_in_arguments_stays_encodable(fmt, text):
    """A JSON escape the model wrote that decodes to a lone surrogate: the arguments keep it as an escape, so the
    response encodes as UTF-8 (it had been a 500, or a stream cut off) and the client's json.loads gets it back."""
    msg = parse(fmt, text)
    (call,) = msg.tool_calls
    call.arguments.encode("utf-8")
    value = json.loads(call.arguments)
    assert ("\ud83d" in value["command"]) if fmt == "hermes" else (value["env"] == {"a": "\udc00"})


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
def test_deeply_nested_arguments(fmt):
    """Arguments 400 lists deep are JSON: checking them had exhausted Python's stack (a RecursionError: a 500)."""
    deep = "[" * 400 + "]" * 400
    if fmt == "hermes":
        text = f'<tool_call>\n{{"name": "run_shell", "arguments": {{"args": {deep}}}}}\n</tool_call>'
    else:
        text = f"<tool_call>\n<function=run_shell>\n<parameter=args>\n{deep}\n</parameter>\n</function>\n</tool_call>"
    msg = parse(fmt, text)
    assert msg.content is None and calls(msg) == [("run_shell", {"args": json.loads(deep)})]
