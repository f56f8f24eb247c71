"""The FastAPI app: settings, the gate every request passes (size, key, loading) and the routers."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI, Request

from flashnext.server.errors import APIError, error_body, install_handlers
from flashnext.server.json_body import JSONBody, json_bytes
from flashnext.server.metrics import ServerMetrics

# Routes a client may call without the API key: probes and scrapers rarely carry one.
_OPEN_PATHS = ("/health", "/metrics")


@dataclass
class ServerSettings:
    served_model_name: str
    model_path: str = ""
    api_key: str | None = None
    max_request_bytes: int = 32 << 20
    keepalive_s: float = 2.0
    tool_call_parser: str = "auto"
    max_num_seqs: int | None = None


EngineProvider = Callable[[], Any]  # returns the AsyncLLM, or None while it loads


def get_engine(request: Request):
    engine = request.app.state.engine_provider()
    if engine is None:
        raise APIError(503, "The model is still loading; retry when /health answers 200.", None,
                       "model_loading", {"Retry-After": "5"})
    return engine


def settings_of(request: Request) -> ServerSettings:
    return request.app.state.settings


def check_model(request: Request, name: str | None) -> str:
    """The name to echo back: the served name, whichever alias the client used."""
    settings = settings_of(request)
    engine = get_engine(request)
    known = {settings.served_model_name, settings.model_path, getattr(engine, "model_name", None),
             getattr(engine, "model_path", None)}
    if name is None or name == "" or name in known:
        return settings.served_model_name
    raise APIError(404, f"The model '{name}' does not exist; this server serves '{settings.served_model_name}'.",
                   "model", "model_not_found")


class _Gate:
    """Pure ASGI middleware, so that a huge or unauthorised body is refused before anyone parses it."""

    def __init__(self, app, settings: ServerSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.settings.api_key and scope["path"] not in _OPEN_PATHS:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
            if not secrets.compare_digest(token.encode(), self.settings.api_key.encode()):
                message = "Missing API key: send 'Authorization: Bearer <key>'." if not token else "Invalid API key."
                return await _send_error(send, 401, message, "invalid_api_key")
        limit = self.settings.max_request_bytes
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await _send_error(send, 400, "Content-Length is not a number.", "invalid_request")
            if int(length) > limit:
                return await _send_error(send, 413, _too_large(limit), "request_too_large")
        elif scope["method"] in ("POST", "PUT", "PATCH"):
            # Chunked upload: buffer it here (up to the limit) and replay it to the app.
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return
                size += len(message.get("body", b""))
                if size > limit:
                    return await _send_error(send, 413, _too_large(limit), "request_too_large")
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    break
            receive = _replay(b"".join(chunks), receive)
        if scope["method"] == "POST" and "json" not in headers.get("content-type", ""):
            # Every POST body here is JSON; curl -d and some clients label it form data or nothing.
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                         + [(b"content-type", b"application/json")])
        return await self.app(scope, receive, send)


def _too_large(limit: int) -> str:
    return f"The request body exceeds the server's limit of {limit} bytes (--max-request-bytes)."


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send, status: int, message: str, code: str):
    payload = json_bytes(error_body(status, message, None, code))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def build_app(engine_provider: EngineProvider, settings: ServerSettings) -> FastAPI:
    from flashnext.server import routes_chat, routes_completions, routes_misc

    app = FastAPI(title="flashnext", docs_url=None, redoc_url=None, openapi_url=None, default_response_class=JSONBody)
    app.state.engine_provider = engine_provider
    app.state.settings = settings
    app.state.started = int(time.time())
    app.state.metrics = ServerMetrics(settings, engine_provider)
    install_handlers(app)
    app.include_router(routes_chat.router)
    app.include_router(routes_completions.router)
    app.include_router(routes_misc.router)
    app.add_middleware(_Gate, settings=settings)
    return app
