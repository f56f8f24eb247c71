"""The request's tools as the parsers need them: which function names exist, and how the text of a
qwen3_coder parameter becomes a JSON value according to the tool's JSON schema."""
from __future__ import annotations

import ast
import json
import math
from collections.abc import KeysView
from typing import Any


class ToolSchemas:
    """Function name -> its `parameters` JSON schema, from the request's `tools`.

    Accepts OpenAI tool dicts ({"type": "function", "function": {...}}), bare function dicts, or pydantic
    models of either (anything with model_dump).
    """

    def __init__(self, tools: Any = None):
        self._parameters: dict[str, dict] = {}
        for tool in tools or ():
            spec = tool.model_dump(exclude_none=True) if hasattr(tool, "model_dump") else tool
            if not isinstance(spec, dict):
                continue
            function = spec.get("function", spec)
            name = function.get("name") if isinstance(function, dict) else None
            if isinstance(name, str) and name:
                parameters = function.get("parameters")
                self._parameters[name] = parameters if isinstance(parameters, dict) else {}

    def __contains__(self, name: str) -> bool:
        return name in self._parameters

    def __bool__(self) -> bool:
        return bool(self._parameters)

    def parameter_schema(self, function: str, parameter: str) -> dict | None:
        schema = self._properties(function).get(parameter)
        return schema if isinstance(schema, dict) else None

    def parameter_names(self, function: str) -> KeysView[str]:
        """The parameters the function's schema lists (none for an unknown function)."""
        return self._properties(function).keys()

    def _properties(self, function: str) -> dict:
        properties = self._parameters.get(function, {}).get("properties")
        return properties if isinstance(properties, dict) else {}


class _Invalid:
    """Marks text that is not a JSON value (None is a valid value, so it cannot mark failure)."""


INVALID = _Invalid()


def _is_json_value(value: Any) -> bool:
    """Iterative: a value nested as deep as the parsers accept would exhaust Python's stack in recursion."""
    stack = [value]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack += value
        elif isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                return False
            stack += value.values()
        elif isinstance(value, float):
            if not math.isfinite(value):  # 1e400 parses to inf, which json.dumps would write as invalid JSON
                return False
        elif not (value is None or isinstance(value, (bool, int, str))):
            return False
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(text: str) -> Any:
    """The JSON value of text, or INVALID. NaN/Infinity are refused: we must re-serialise as strict JSON."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return INVALID
    return value if _is_json_value(value) else INVALID


def _tuples_to_lists(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_tuples_to_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _tuples_to_lists(v) for k, v in value.items()}
    return value


def parse_literal(text: str) -> Any:
    """JSON first, then a Python literal (True, None, single quotes: what models write by habit)."""
    value = parse_json(text)
    if value is not INVALID:
        return value
    try:
        value = _tuples_to_lists(ast.literal_eval(text))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return INVALID
    return value if _is_json_value(value) else INVALID


def _schema_types(schema: Any) -> set[str] | None:
    """The JSON types a schema allows, or None when it does not say (the value then stays a string)."""
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)} or None
    branches = [*(schema.get("anyOf") or ()), *(schema.get("oneOf") or ())]
    if branches:
        types: set[str] = set()
        for branch in branches:
            branch_types = _schema_types(branch)
            if branch_types is None:  # one untyped branch accepts anything
                return None
            types |= branch_types
        return types
    choices = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return {"string"}
    return None


def strip_framing_newlines(raw: str) -> str:
    """The format writes a value as `<parameter=k>\\nVALUE\\n</parameter>`: remove exactly those two."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


def coerce_parameter(raw: str, schema: dict | None) -> Any:
    """The JSON value of one qwen3_coder parameter, typed by its JSON schema.

    Strings are kept verbatim (code keeps its indentation and inner newlines). Other declared types are
    parsed as JSON, then as a Python literal; text that is neither stays a string, so the tool itself
    reports the bad argument to the agent. A parameter whose schema declares no type, or that the tool's
    schema does not list, is a string whatever it looks like (`123`, `{"a": 1}`, `null`): what vLLM's
    qwen3_coder parser gives, so an agent sees the same arguments from either server.
    """
    text = strip_framing_newlines(raw)
    types = _schema_types(schema)
    if types is None:
        return text
    if "string" in types:
        if "null" in types and text.strip() in ("null", "None"):
            return None
        return text
    value = parse_literal(text.strip())
    if value is INVALID:
        return text
    if isinstance(value, float) and value.is_integer() and "integer" in types and "number" not in types:
        return int(value)
    # a value of another type than declared ("1,000" parses as the tuple (1, 0)) is not what the model meant; a
    # schema with names JSON schema does not have ("int", "float": hand-written tools) gets what parses, and null
    # (an optional parameter left out) goes through
    if value is None or not types <= _JSON_TYPES:
        return value
    kind = _json_type(value)
    return value if kind in types or (kind == "integer" and "number" in types) else text


_JSON_TYPES = frozenset({"string", "integer", "number", "boolean", "array", "object", "null"})


def _json_type(value: Any) -> str:
    """The JSON schema type of a parsed JSON value other than null."""
    if isinstance(value, bool):   # before int: bool is an int in Python
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
