"""Sending a request upstream and turning the answer into the client's response."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from proxy.access_log import log_request
from proxy.backends.pool import BACKEND_EXTENSION
from proxy.context import RequestContext
from proxy.errors import ProxyError, normalize_upstream_error
from proxy.jsonio import loads
from proxy.relay import SSERelay
from proxy.state import ProxyState, get_state
from proxy.streaming import RelayResponse
from proxy.tenants import Tenant
from proxy.upstream import upstream_error_kind
from proxy.usage import Usage

REQUEST_ID_HEADER = "x-request-id"


def new_context(request: Request, route: str) -> RequestContext:
    ctx = RequestContext(route=route)
    incoming = request.headers.get(REQUEST_ID_HEADER)
    if incoming and len(incoming) <= 128 and incoming.isprintable():
        ctx.request_id = incoming
    return ctx


async def authenticate(state: ProxyState, request: Request, ctx: RequestContext) -> Tenant:
    """The caller's tenant (401 when keys are configured and none matches), recorded on ``ctx``."""
    tenant = await state.tenants.authenticate(request.headers.get("authorization"))
    ctx.tenant = tenant.name
    ctx.upstream_api_key = tenant.upstream_api_key
    return tenant


Handler = Callable[[ProxyState, Request, RequestContext, Tenant], Awaitable[Response]]


def api_endpoint(route: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """An endpoint of the forwarded API: ``handler`` gets a request context and the caller's tenant,
    and any :class:`ProxyError` it raises is answered (and counted) in OpenAI's error shape."""

    async def endpoint(request: Request) -> Response:
        state = get_state(request)
        ctx = new_context(request, route)
        try:
            tenant = await authenticate(state, request, ctx)
            return await handler(state, request, ctx, tenant)
        except ProxyError as error:
            return error_response(state, ctx, error)

    return endpoint


def upstream_headers(state: ProxyState, request: Request, ctx: RequestContext) -> dict[str, str]:
    headers = {"content-type": "application/json", REQUEST_ID_HEADER: ctx.request_id}
    if ctx.upstream_api_key:
        headers["authorization"] = f"Bearer {ctx.upstream_api_key}"
    elif state.tenants.open:
        headers.update(state.upstream.auth_headers(request.headers.get("authorization")))
    else:
        # The client's Authorization carries its proxy key, which the upstream must never see.
        headers.update(state.upstream.auth_headers(None))
    return headers


def proxy_headers(ctx: RequestContext) -> dict[str, str]:
    headers = {REQUEST_ID_HEADER: ctx.request_id}
    if ctx.actions:
        headers["x-prefix-proxy-actions"] = ",".join(ctx.actions)[:4000]
    if ctx.prefix_hash:
        headers["x-prefix-proxy-prefix"] = ctx.prefix_hash
    if ctx.session_id:
        headers["x-prefix-proxy-session"] = ctx.session_id
    return headers


def finish(state: ProxyState, ctx: RequestContext, overhead: float | None = None) -> float:
    """Record metrics and the access-log line; returns the proxy overhead in seconds."""
    if overhead is None:
        overhead = ctx.overhead_seconds()
    metrics = state.metrics
    metrics.record_request(ctx.route, ctx.status, ctx.model, ctx.tenant)
    metrics.overhead.labels(ctx.route).observe(overhead)
    upstream = ctx.upstream_seconds()
    if upstream is not None:
        metrics.upstream_latency.labels(ctx.route).observe(upstream)
    if ctx.usage is not None:
        metrics.record_usage(ctx.model or "", ctx.tenant, ctx.usage)
        if ctx.saved_by_canonicalization and ctx.usage.cached_tokens:
            metrics.record_saved(ctx.model or "", ctx.tenant, "canonicalization", ctx.usage.cached_tokens)
    log_request(ctx, overhead * 1000)
    return overhead


def error_response(state: ProxyState, ctx: RequestContext, error: ProxyError) -> Response:
    ctx.status = error.status
    ctx.error_code = error.code or error.type
    if ctx.upstream_sent is not None and ctx.upstream_done is None:
        # Waiting for an upstream that failed (timeout, connection refused) is upstream time, not overhead.
        ctx.upstream_done = time.perf_counter()
    if error.type == "upstream_error" and error.status in (502, 504):
        state.metrics.upstream_errors.labels(ctx.route, upstream_error_kind(error)).inc()
    overhead = finish(state, ctx)
    headers = proxy_headers(ctx)
    headers["x-prefix-proxy-overhead-ms"] = f"{overhead * 1000:.3f}"
    return error.response(headers)


async def send_json(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    path: str,
    payload: bytes | None,
    *,
    on_reply: Callable[[dict[str, Any]], None] | None = None,
    method: str = "POST",
) -> Response:
    """Forward a non-streaming request; the upstream's bytes reach the client unchanged."""
    response = await open_upstream(state, request, ctx, method, path, payload)
    ctx.upstream_headers = time.perf_counter()
    raw = await state.upstream.read(response)
    ctx.upstream_done = time.perf_counter()
    ctx.status = response.status_code
    if response.status_code >= 400:
        return upstream_error(state, ctx, response.status_code, raw)
    parsed = _parse(raw)
    if parsed is not None:
        ctx.usage = Usage.from_openai(parsed.get("usage"))
        if on_reply is not None:
            on_reply(parsed)
    headers = proxy_headers(ctx)
    if ctx.usage is not None:
        headers["x-prefix-proxy-prompt-tokens"] = str(ctx.usage.prompt_tokens)
        headers["x-prefix-proxy-cached-tokens"] = str(ctx.usage.cached_tokens)
    overhead = finish(state, ctx)
    headers["x-prefix-proxy-overhead-ms"] = f"{overhead * 1000:.3f}"
    return Response(raw, status_code=response.status_code, headers=headers, media_type="application/json")


async def send_stream(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    path: str,
    payload: bytes,
    *,
    client_wants_usage: bool,
    on_complete: Callable[[SSERelay], None] | None = None,
    on_incomplete: Callable[[SSERelay], None] | None = None,
    record_content: bool = False,
) -> Response:
    """Forward a streaming request; each SSE event reaches the client as soon as it is complete."""
    response = await open_upstream(state, request, ctx, "POST", path, payload)
    upstream_started = ctx.upstream_headers = time.perf_counter()
    ctx.status = response.status_code
    if response.status_code >= 400:
        raw = await state.upstream.read(response)
        ctx.upstream_done = time.perf_counter()
        return upstream_error(state, ctx, response.status_code, raw)

    def first_chunk() -> None:
        ctx.first_chunk = time.perf_counter()
        state.metrics.ttft.labels(state.metrics.model_label(ctx.model)).observe(ctx.first_chunk - ctx.started)

    relay = SSERelay(
        response,
        client_wants_usage=client_wants_usage,
        on_first_chunk=first_chunk,
        record_content=record_content,
    )

    def on_finish(disconnected: bool) -> None:
        ctx.upstream_done = time.perf_counter()
        ctx.usage = relay.usage
        # A disconnect noticed after the last event was relayed is just the client hanging up.
        if not relay.completed:
            state.metrics.streams_cancelled.inc()
            ctx.error_code = "client_disconnected" if disconnected else "stream_interrupted"
            if on_incomplete is not None:
                on_incomplete(relay)
        elif on_complete is not None:
            on_complete(relay)
        # Only the time until the stream started is proxy time; the relay itself runs at upstream pace.
        overhead = ctx.pre_upstream_seconds() + (headers_ready - upstream_started)
        finish(state, ctx, overhead)

    headers = proxy_headers(ctx)
    headers["cache-control"] = "no-cache"
    headers["x-accel-buffering"] = "no"
    headers_ready = time.perf_counter()
    headers["x-prefix-proxy-overhead-ms"] = (
        f"{(ctx.pre_upstream_seconds() + headers_ready - upstream_started) * 1000:.3f}"
    )
    return RelayResponse(relay, headers=headers, on_finish=on_finish, close=relay.aclose)


async def open_upstream(
    state: ProxyState, request: Request, ctx: RequestContext, method: str, path: str, payload: bytes | None
) -> httpx.Response:
    ctx.mark_upstream_sent()
    response = await state.upstream.open(
        method,
        path,
        content=payload,
        headers=upstream_headers(state, request, ctx),
        key=ctx.route_key,
        model=ctx.model,
    )
    ctx.backend = response.extensions.get(BACKEND_EXTENSION)
    return response


def upstream_error(state: ProxyState, ctx: RequestContext, status: int, raw: bytes) -> Response:
    state.metrics.upstream_errors.labels(ctx.route, "http_4xx" if status < 500 else "http_5xx").inc()
    ctx.error_code = f"upstream_{status}"
    overhead = finish(state, ctx)
    headers = proxy_headers(ctx)
    headers["x-prefix-proxy-overhead-ms"] = f"{overhead * 1000:.3f}"
    return Response(
        normalize_upstream_error(status, raw),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        parsed = loads(raw)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def with_upstream_usage(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body asking the upstream for the usage chunk, and whether the client asked for it itself."""
    options = body.get("stream_options")
    options = options if isinstance(options, dict) else {}
    return {**body, "stream_options": {**options, "include_usage": True}}, bool(options.get("include_usage"))
