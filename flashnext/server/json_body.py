"""JSON as the server sends it: UTF-8 with non-ASCII as itself — unless the value holds a lone surrogate.

A lone surrogate ("\\ud83d") is a Python character with no UTF-8. It gets in through a JSON escape (in tool-call
arguments the model wrote, in a request quoted by an error) and through command-line bytes that are not UTF-8
(a served model name or path in Latin-1: surrogateescape). Encoding it raises: a 500, or a stream cut off without
[DONE]. Such a value goes out with \\u escapes instead, which JSON carries losslessly — the client decodes the
very same string. Every JSON body, stream chunk and nested JSON text of ours is made here, so all follow this rule.
"""
from __future__ import annotations

import json

from fastapi.responses import JSONResponse

COMPACT = (",", ":")


def json_bytes(value, separators: tuple[str, str] = COMPACT) -> bytes:
    # allow_nan=False as Starlette's JSONResponse: NaN is not JSON, and strict clients would refuse the whole body.
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=separators)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=separators).encode("ascii")


def json_text(value, separators: tuple[str, str] = COMPACT) -> str:
    """JSON that goes inside another body as a string (a tool call's arguments). It must encode on its own: else the
    body holding it falls back to escapes, and the client's string holds the lone surrogate itself (which strict JSON
    decoders refuse) rather than its escape."""
    return json_bytes(value, separators).decode("utf-8")


class JSONBody(JSONResponse):
    """The app's response class, so that route results and error bodies are rendered by json_bytes."""

    def render(self, content) -> bytes:
        return json_bytes(content)
