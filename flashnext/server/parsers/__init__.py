"""Parsers of generated chat text: reasoning, content and tool calls (hermes and qwen3_coder formats)."""
from flashnext.server.parsers.chat_output import ChatOutputParser, new_call_id
from flashnext.server.parsers.messages import (ContentDelta, Delta, ParsedMessage, ReasoningDelta, ToolCall,
                                                ToolCallArguments, ToolCallStart, collect)
from flashnext.server.parsers.registry import TOOL_PARSERS, detect_tool_format, get_tool_parser
from flashnext.server.parsers.tool_schema import ToolSchemas, coerce_parameter

__all__ = [
    "ChatOutputParser", "new_call_id", "ContentDelta", "Delta", "ParsedMessage", "ReasoningDelta", "ToolCall",
    "ToolCallArguments", "ToolCallStart", "collect", "TOOL_PARSERS", "detect_tool_format", "get_tool_parser",
    "ToolSchemas", "coerce_parameter",
]
