"""OpenAI request fields → a checked StructuredOutput, or an InvalidParams naming the field to fix.

- `tool_choice: "required"`: one or more calls of any offered tool (one when parallel_tool_calls is false);
  a named tool_choice: exactly one call of that tool. "auto" and "none" constrain nothing.
- `response_format`: json_object → any JSON object; json_schema → its `schema` (enforced whether or not
  `strict` is set: a schema is what the client asked for). A forced tool choice wins over it: the answer
  is then a call, not content.
"""
from __future__ import annotations

from typing import Any

from flashnext.engine.sampling_params import InvalidParams
from flashnext.engine.structured.grammars import Reasoning, StructuredOutput, json_output, tool_calls


def reasoning_mode(thinking: bool, starts_in_reasoning: bool) -> Reasoning:
    if not thinking:
        return Reasoning.OFF
    return Reasoning.OPEN if starts_in_reasoning else Reasoning.OPTIONAL


def from_response_format(response_format: dict[str, Any] | None,
                         reasoning: Reasoning = Reasoning.OFF) -> StructuredOutput | None:
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return checked(json_output(None, reasoning))
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidParams("response_format", "response_format of type json_schema needs a json_schema object "
                                               "with the schema in json_schema.schema.")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidParams("response_format", "response_format.json_schema.schema must be a JSON schema object.")
    return checked(json_output(schema, reasoning))


def from_tool_choice(tools: list[dict] | None, tool_choice: Any, tool_format: str | None,
                     reasoning: Reasoning = Reasoning.OFF, parallel: bool = True) -> StructuredOutput | None:
    """tools: what the template was shown (already narrowed to the named tool for a named choice)."""
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if not forced:
        return None
    if not tools:
        raise InvalidParams("tool_choice", 'tool_choice "required" or a named function needs a non-empty tools list.')
    if tool_format is None:
        raise InvalidParams("tool_choice", "this model's chat template has no tool-call format to enforce.")
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters")
        if parameters is not None and not isinstance(parameters.get("properties", {}), dict):
            raise InvalidParams(f"tools[{i}].function.parameters", "parameters.properties must be an object.")
    return checked(tool_calls(tools, tool_format, reasoning=reasoning,
                              parallel=parallel and tool_choice == "required"))


def checked(spec: StructuredOutput) -> StructuredOutput:
    """The spec, once xgrammar has turned it into a grammar; a schema it cannot use is the user's 400."""
    from flashnext.engine.structured.backend import InvalidConstraint, check

    try:
        check(spec)
    except InvalidConstraint as exc:
        what = "a tool's parameters schema" if spec.param == "tools" else "the response_format schema"
        raise InvalidParams(spec.param, f"Invalid JSON schema in {what}: {exc}") from None
    return spec
