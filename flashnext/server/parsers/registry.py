"""Tool-call formats by name, and which one a chat template speaks."""
from __future__ import annotations

from flashnext.server.parsers.hermes import HermesCallScanner
from flashnext.server.parsers.qwen3_coder import FUNCTION_OPEN, Qwen3CoderCallScanner
from flashnext.server.parsers.scanning import ToolCallScanner

TOOL_PARSERS: dict[str, type[ToolCallScanner]] = {
    "hermes": HermesCallScanner,
    "qwen3_coder": Qwen3CoderCallScanner,
}


def get_tool_parser(name: str) -> type[ToolCallScanner]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


def detect_tool_format(chat_template_text: str) -> str:
    """Templates that teach the XML format show the model `<function=`; the others teach hermes JSON."""
    return "qwen3_coder" if FUNCTION_OPEN in chat_template_text else "hermes"
