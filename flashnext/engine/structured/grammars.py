"""What a constrained request may generate, written as an xgrammar structural tag (plain JSON data).

Built here without xgrammar, so the server can describe a constraint cheaply; `backend.check` turns it into
a grammar (the step that rejects a bad schema) and `GrammarBackend.constraint` compiles it against the
vocabulary.

Decisions:
- Tool calls follow the chat template's own format byte for byte (what the parsers read, and what the
  model was trained on): whitespace is fixed, never "any whitespace", because a random or confused model
  handed free whitespace can spend its whole budget on newlines.
- qwen3_coder values: a parameter whose schema allows a string is raw text (the parser keeps it verbatim;
  enum, pattern and length limits still apply), any other is a JSON value of its schema. Parameters come
  in the schema's declared order, required ones always, optional ones maybe; undeclared ones never.
- A reasoning block comes first when thinking is on: free text up to `</think>` (the prompt may already
  have opened `<think>`), then the `\\n\\n` the template writes after it, then the constrained part.
- After the constrained part only an end-of-sequence token may follow (xgrammar's stop tokens).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Consecutive whitespace inside JSON: enough for pretty-printing, short of a runaway model.
MAX_JSON_WHITESPACE = 4


class Reasoning(Enum):
    OFF = "off"            # thinking disabled (or a completions prompt): the constrained part starts at once
    OPEN = "open"          # the prompt ends inside `<think>`: free text up to `</think>` first
    OPTIONAL = "optional"  # the model may open a `<think>` block before the constrained part


@dataclass(frozen=True)
class StructuredOutput:
    """A request's constraint: a structural tag as JSON text (hashable, the key of the compile cache)."""
    structural_tag: str
    kind: str  # "json_object", "json_schema", "tool_calls": for messages and logs

    @property
    def param(self) -> str:
        """The request field a user fixes when this constraint is rejected."""
        return "tools" if self.kind == "tool_calls" else "response_format"

    @classmethod
    def of(cls, fmt: dict, kind: str) -> StructuredOutput:
        # Key order is kept: a schema's properties are generated in their declared order.
        return cls(json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False), kind)


def _const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def _seq(*elements: dict) -> dict:
    elements = [e for e in elements if e is not None]
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _or(elements: list[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _json(schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": _length_as_pattern(schema), "style": "json",
            "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _length_as_pattern(schema: Any) -> Any:
    """A copy where each string with minLength/maxLength (and no pattern of its own) has them as a pattern.

    xgrammar 0.2.9 writes such a string as `"` + any character but quote, backslash, CR, LF + `"`, which
    lets raw control characters through: invalid JSON the parser then refuses. The pattern names the
    characters JSON allows unescaped.
    """
    if isinstance(schema, list):
        return [_length_as_pattern(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _length_as_pattern(v) for k, v in schema.items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and types == ["string"])
    bounded = "minLength" in out or "maxLength" in out
    if is_string and bounded and not any(k in out for k in ("pattern", "format", "enum", "const")):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = '^[^\\x00-\\x1f"\\\\]{%s,%s}$' % (low, high)
    return out


def _reasoning(mode: Reasoning) -> dict | None:
    block = _seq({"type": "tag", "begin": "" if mode is Reasoning.OPEN else THINK_OPEN,
                  "content": {"type": "any_text", "excludes": [THINK_OPEN, THINK_CLOSE]}, "end": THINK_CLOSE},
                 _const("\n\n"))
    if mode is Reasoning.OPEN:
        return block
    if mode is Reasoning.OPTIONAL:
        return {"type": "optional", "content": block}
    return None


def json_output(schema: dict | None, reasoning: Reasoning = Reasoning.OFF) -> StructuredOutput:
    """response_format json_schema (schema given) or json_object (None: any JSON object)."""
    kind = "json_object" if schema is None else "json_schema"
    return StructuredOutput.of(_seq(_reasoning(reasoning), _json({"type": "object"} if schema is None else schema)),
                               kind)


# ---- tool calls ----

def _schema_types(schema: dict) -> set[str] | None:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return set(declared)
    branches = [*(schema.get("anyOf") or ()), *(schema.get("oneOf") or ())]
    if branches:
        types = [_schema_types(b) if isinstance(b, dict) else None for b in branches]
        return None if any(t is None for t in types) else set().union(*types)
    choices = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
    if choices and all(isinstance(c, str) for c in choices):
        return {"string"}
    return None


def _raw_string(schema: dict) -> dict:
    """A qwen3_coder string value: the text between `<parameter=K>\\n` and `\\n</parameter>`."""
    choices = [c for c in schema.get("enum") or ([schema["const"]] if "const" in schema else ()) if isinstance(c, str)]
    if choices:
        return _or([_const(c) for c in choices])
    if isinstance(schema.get("pattern"), str):  # matched whole, as if anchored (JSON schema searches)
        return {"type": "regex", "pattern": schema["pattern"]}
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if low or high is not None:
        # The parser strips exactly one framing newline each side, so the value is counted as written.
        return {"type": "regex", "pattern": "[\\s\\S]{%d,%s}" % (low, "" if high is None else high)}
    return {"type": "any_text", "excludes": ["</parameter>"]}


def _xml_parameter(name: str, schema: dict) -> dict:
    types = _schema_types(schema)
    if types is not None and "string" in types:
        value = _raw_string(schema)
    else:
        value = _json(schema)
    return _seq(_const(f"<parameter={name}>\n"), value, _const("\n</parameter>\n"))


def _xml_call(name: str, parameters: dict) -> dict:
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    pieces = []
    for key, schema in properties.items():
        piece = _xml_parameter(key, schema if isinstance(schema, dict) else {})
        pieces.append(piece if key in required else {"type": "optional", "content": piece})
    return _seq(_const(f"<tool_call>\n<function={name}>\n"), *pieces, _const("</function>\n</tool_call>"))


def _hermes_call(name: str, parameters: dict) -> dict:
    head = '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
    return _seq(_const(head), _json(parameters or {"type": "object"}), _const("}\n</tool_call>"))


TOOL_CALL_BUILDERS = {"qwen3_coder": _xml_call, "hermes": _hermes_call}


def tool_calls(tools: list[dict], tool_format: str, *, reasoning: Reasoning = Reasoning.OFF,
               parallel: bool = True) -> StructuredOutput:
    """One or more calls (one when not parallel) of the given tools, in the template's format, then EOS.

    tools: OpenAI tool dicts ({"type": "function", "function": {"name", "parameters"}}); tool_choice
    "required" passes all of them, a named tool_choice just that one.
    """
    build = TOOL_CALL_BUILDERS[tool_format]
    calls = []
    for tool in tools:
        function = tool.get("function", tool)
        parameters = function.get("parameters")
        calls.append(build(function["name"], parameters if isinstance(parameters, dict) else {}))
    call = _or(calls)
    more = {"type": "star", "content": _seq(_const("\n"), call)} if parallel else None
    return StructuredOutput.of(_seq(_reasoning(reasoning), call, more), "tool_calls")
