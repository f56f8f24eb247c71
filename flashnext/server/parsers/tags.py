"""The literal tags of Qwen chat output, and the small text tests every scanner needs."""
from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# Returned by match_literal when the text so far is a proper prefix of what is expected.
PENDING = -1
# Returned by match_literal when the text can no longer become what is expected.
MISMATCH = -2


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag: what must be held back."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def match_literal(text: str, pos: int, *literals: str) -> tuple[int, str | None]:
    """After optional whitespace at pos, which of literals follows: (end of it, literal).

    (PENDING, None) while the text may still become one of them, (MISMATCH, None) once it cannot.
    """
    pos = skip_whitespace(text, pos)
    rest = text[pos:pos + max(map(len, literals))]
    for literal in literals:
        if rest.startswith(literal):
            return pos + len(literal), literal
    if any(literal.startswith(rest) for literal in literals):
        return PENDING, None
    return MISMATCH, None
