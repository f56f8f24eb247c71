"""Constrained decoding: response_format JSON and forced tool calls, enforced with xgrammar token masks.

`grammars` says what may be generated (pure data, no xgrammar); `backend` checks and compiles that against
the vocabulary and masks the logits of constrained rows.
"""
from flashnext.engine.structured.grammars import Reasoning, StructuredOutput, json_output, tool_calls

__all__ = ["Reasoning", "StructuredOutput", "json_output", "tool_calls"]
