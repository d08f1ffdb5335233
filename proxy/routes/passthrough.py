"""Routes the proxy forwards without rewriting: completions, embeddings, models."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.app_state import ProxyState
from proxy.http.body import parse_json_object, read_body, require_model, validate_completion_request
from proxy.http.context import RequestContext
from proxy.http.errors import upstream_unreachable
from proxy.openai.jsonio import dumps
from proxy.routes.forward import (
    api_endpoint,
    send_json,
    send_stream,
    upstream_error,
    upstream_headers,
    whole_answer,
    with_upstream_usage,
)
from proxy.tenants import Tenant


async def completions(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
    validate_completion_request(body)
    body = state.tenants.cache_salted(tenant, body)
    ctx.model = body["model"]
    ctx.stream = bool(body.get("stream"))
    if not ctx.stream:
        return await send_json(state, request, ctx, "/completions", dumps(body))
    body, wants_usage = with_upstream_usage(body)
    return await send_stream(state, request, ctx, "/completions", dumps(body), client_wants_usage=wants_usage)


async def embeddings(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    raw = await read_body(request, state.settings.max_body_bytes)
    ctx.model = require_model(parse_json_object(raw))
    return await send_json(state, request, ctx, "/embeddings", raw)


async def models(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    if state.backends.single:
        return await send_json(state, request, ctx, "/models", None, method="GET")
    return await merged_models(state, request, ctx)


async def merged_models(state: ProxyState, request: Request, ctx: RequestContext) -> Response:
    """Several backends: one list of every model any live backend serves to the caller's credentials."""
    ctx.mark_upstream_sent()
    listing = await state.backends.list_models(upstream_headers(state, request, ctx))
    ctx.upstream_done_at = time.perf_counter()
    if listing.data is None and listing.refusal is not None:
        return upstream_error(state, ctx, listing.refusal.status_code, listing.refusal.content)
    if listing.data is None:
        raise upstream_unreachable("no backend answered")
    body = dumps({"object": "list", "data": listing.data})
    return whole_answer(state, ctx, body, 200)


routes = [
    Route("/v1/completions", api_endpoint("completions", completions), methods=["POST"]),
    Route("/v1/embeddings", api_endpoint("embeddings", embeddings), methods=["POST"]),
    Route("/v1/models", api_endpoint("models", models), methods=["GET"]),
]
