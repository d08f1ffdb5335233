"""Routes the proxy forwards without rewriting: completions, embeddings, models."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.body import parse_json_object, read_body, require_model, validate_completion_request
from proxy.errors import ProxyError
from proxy.forward import (
    authenticate,
    error_response,
    new_context,
    send_json,
    send_stream,
    with_upstream_usage,
)
from proxy.jsonio import dumps
from proxy.state import get_state


async def completions(request: Request) -> Response:
    state = get_state(request)
    ctx = new_context(request, "completions")
    try:
        await authenticate(state, request, ctx)
        body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
        validate_completion_request(body)
        ctx.model = body["model"]
        ctx.stream = bool(body.get("stream"))
        if not ctx.stream:
            return await send_json(state, request, ctx, "/completions", dumps(body))
        body, wants_usage = with_upstream_usage(body)
        return await send_stream(state, request, ctx, "/completions", dumps(body), client_wants_usage=wants_usage)
    except ProxyError as error:
        return error_response(state, ctx, error)


async def embeddings(request: Request) -> Response:
    state = get_state(request)
    ctx = new_context(request, "embeddings")
    try:
        await authenticate(state, request, ctx)
        raw = await read_body(request, state.settings.max_body_bytes)
        ctx.model = require_model(parse_json_object(raw))
        return await send_json(state, request, ctx, "/embeddings", raw)
    except ProxyError as error:
        return error_response(state, ctx, error)


async def models(request: Request) -> Response:
    state = get_state(request)
    ctx = new_context(request, "models")
    try:
        await authenticate(state, request, ctx)
        return await send_json(state, request, ctx, "/models", None, method="GET")
    except ProxyError as error:
        return error_response(state, ctx, error)


routes = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
]
