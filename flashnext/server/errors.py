"""Every error leaves the server as OpenAI's `{"error": {"message", "type", "param", "code"}}`.

Anything a client can cause is a 4xx with words that name the field; a 500 means a bug of ours, and its
traceback goes to the log.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashnext.engine.sampling_params import InvalidParams
from flashnext.server.json_body import JSONBody
from flashnext.tokenizer.tokenizer import InvalidText

log = logging.getLogger("flashnext.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "internal_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONBody:
    # A message may quote what the user sent, lone surrogates included: JSONBody encodes them.
    return JSONBody(error_body(status, message, param, code), status_code=status, headers=headers)


def from_exception(exc: BaseException) -> APIError | None:
    """The client-facing error for an exception raised while serving a request, or None for a bug."""
    from flashnext.engine import errors as engine_errors  # the engine package may still be loading

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParams):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, InvalidText):
        return APIError(400, f"Invalid text: {exc}", None, "invalid_text")
    if isinstance(exc, engine_errors.RequestRejected):
        return APIError(400, str(exc), getattr(exc, "param", None), getattr(exc, "code", None))
    if isinstance(exc, engine_errors.EngineOverloaded):
        retry = max(1, round(getattr(exc, "retry_after_s", 1) or 1))
        return APIError(429, f"The server is overloaded, retry in {retry} s.", None, "server_overloaded",
                        {"Retry-After": str(retry)})
    return None


def _validation_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # Union members show up as loc entries like "str" or "list[int]"; they say nothing to a client.
    parts = [p for p in parts if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool",
                                                                               "function-after")]
    return ".".join(parts) or None


def summarise_validation(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON: {detail}".rstrip(": "), None, "invalid_json")
    first = errors[0]
    param = _validation_param(tuple(first.get("loc", ())))
    msgs = []
    for e in errors[:3]:
        where = _validation_param(tuple(e.get("loc", ()))) or "body"
        msgs.append(f"{where}: {e.get('msg')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return APIError(400, "Invalid request: " + "; ".join(msgs) + more, param, "invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        err = summarise_validation(exc)
        return error_response(err.status, err.message, err.param, err.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = {404: f"Route {request.method} {request.url.path} not found.",
                   405: f"Method {request.method} not allowed on {request.url.path}."}.get(exc.status_code,
                                                                                       str(exc.detail))
        return error_response(exc.status_code, message, None, None, getattr(exc, "headers", None))

    async def _client_error(request: Request, exc: Exception):
        err = from_exception(exc)
        return error_response(err.status, err.message, err.param, err.code, err.headers)

    for exc_type in (APIError, InvalidParams, InvalidText, *_engine_error_types()):
        app.add_exception_handler(exc_type, _client_error)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):
        # Runs in Starlette's outermost middleware, which re-raises after answering: uvicorn logs it too.
        log.error("internal error serving %s %s", request.method, request.url.path)
        return error_response(500, f"Internal server error: {type(exc).__name__}. This is a bug; the server log "
                                   "has the traceback.", None, "internal_error")


def _engine_error_types() -> tuple[type, ...]:
    from flashnext.engine import errors as engine_errors

    return engine_errors.RequestRejected, engine_errors.EngineOverloaded
