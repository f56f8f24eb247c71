"""Everything but generation: models, health, metrics, tokenize/detokenize, llama.cpp's /props, debug."""
from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import Response

from flashnext.server.app import check_model, get_engine, settings_of
from flashnext.server.errors import APIError, error_response
from flashnext.server.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])   # HEAD: probes that only look at the status
async def health(request: Request):
    if request.app.state.engine_provider() is None:
        return error_response(503, "The model is still loading.", None, "model_loading", {"Retry-After": "5"})
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    body, content_type = request.app.state.metrics.render()
    return Response(body, media_type=content_type)


@router.get("/v1/models")
async def models(request: Request):
    engine, settings = get_engine(request), settings_of(request)
    card = {"id": settings.served_model_name, "object": "model", "created": request.app.state.started,
            "owned_by": "flashnext", "root": settings.model_path or settings.served_model_name,
            "max_model_len": engine.max_model_len}
    return {"object": "list", "data": [card]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request):
    check_model(request, model)
    return (await models(request))["data"][0]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    from flashnext.server.routes_chat import render_chat

    engine = get_engine(request)
    check_model(request, body.model)
    given = [name for name in ("prompt", "content", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise APIError(400, "Send exactly one of 'prompt', 'content' (text) or 'messages' (a chat).", "prompt")
    if body.messages is not None:
        ids = (await render_chat(engine, body)).prompt_ids
    else:
        ids = engine.tokenizer.encode(body.prompt if body.prompt is not None else body.content)
    if body.content is not None:
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": engine.tokenizer.decode([t], skip_special_tokens=False)} for t in ids]}
        return {"tokens": ids}
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    engine = get_engine(request)
    check_model(request, body.model)
    vocab = getattr(engine.tokenizer, "vocab_size", None)
    if any(t < 0 or (vocab is not None and t >= vocab) for t in body.tokens):
        raise APIError(400, f"tokens holds ids outside the vocabulary [0, {vocab}).", "tokens")
    text = engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return {"prompt": text, "content": text}


@router.get("/props")
async def props(request: Request):
    engine, settings = get_engine(request), settings_of(request)
    return {"default_generation_settings": {"n_ctx": engine.max_model_len, "params": {"n_predict": -1}},
            "total_slots": settings.max_num_seqs or getattr(engine, "max_num_seqs", 1),
            "model_path": settings.model_path, "model_alias": settings.served_model_name,
            "chat_template": getattr(engine.tokenizer, "chat_template", None) or ""}


@router.get("/debug/engine")
async def debug_engine(request: Request):
    stats = get_engine(request).stats()
    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(vars(stats))
