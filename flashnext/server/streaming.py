"""Server-sent events as OpenAI sends them: `data: {json}` frames, `: keep-alive` comments while the
model is silent (long prefills), an error frame if generation fails mid-stream, then `data: [DONE]`."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Protocol

from fastapi.responses import StreamingResponse

from flashnext.server.errors import error_body, from_exception
from flashnext.server.generation import Fanout
from flashnext.server.json_body import json_bytes

log = logging.getLogger("flashnext.server")

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json_bytes(payload) + b"\n\n"


class ChunkWriter(Protocol):
    """Turns engine outputs into the endpoint's chunk objects."""

    def start(self) -> list[dict]: ...
    def output(self, index: int, out) -> list[dict]: ...
    def end(self) -> list[dict]: ...


async def event_stream(fan: Fanout, writer: ChunkWriter, keepalive_s: float) -> AsyncIterator[bytes]:
    try:
        for chunk in writer.start():
            yield sse(chunk)
        async for event in fan.events(timeout=keepalive_s):
            if event is None:
                yield KEEPALIVE
                continue
            for chunk in writer.output(*event):
                yield sse(chunk)
        for chunk in writer.end():
            yield sse(chunk)
    except asyncio.CancelledError:
        log.info("client disconnected mid-stream; aborted %s", ", ".join(j.request_id for j in fan.jobs))
        raise
    except Exception as exc:
        err = from_exception(exc)
        if err is None:
            log.exception("generation failed mid-stream")
            yield sse(error_body(500, f"Generation failed: {type(exc).__name__}: {exc}", None, "internal_error"))
        else:
            yield sse(error_body(err.status, err.message, err.param, err.code))
    finally:
        # A client that disconnects lands here through cancellation: this aborts its engine requests.
        await fan.close()
    yield DONE


def sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
