"""Anthropic Messages: ``POST /v1/messages`` through the pipeline, ``/v1/messages/count_tokens`` forwarded.

Errors on these routes are in Anthropic's shape (``{"type": "error", "error": {...}}``), which
is what Anthropic SDKs raise typed exceptions for; the key may come as ``x-api-key``.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.app_state import ProxyState
from proxy.http.body import parse_json_object, read_body
from proxy.http.context import RequestContext
from proxy.http.dialect import ANTHROPIC
from proxy.protocols import anthropic
from proxy.routes.forward import api_endpoint, send_json
from proxy.routes.pipeline import ProtocolRoute, forward_turn
from proxy.tenants import Tenant

MESSAGES = ProtocolRoute(
    path="/messages",
    relay_class=anthropic.AnthropicRelay,
    read_usage=anthropic.read_usage,
    reply_of=anthropic.reply_message,
    channel=anthropic.AnthropicChannel,
    observed=True,
)


async def messages(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
    anthropic.validate_request(body)
    return await forward_turn(
        state,
        request,
        ctx,
        tenant,
        anthropic.AnthropicView.of(body, state.canonicalizer.tool_orders, tenant.name),
        MESSAGES,
    )


async def count_tokens(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    """Forwarded as sent: the count of what vLLM renders (canonicalization does not change it)."""
    raw = await read_body(request, state.settings.max_body_bytes)
    body = parse_json_object(raw)
    anthropic.validate_request(body, count_tokens=True)
    ctx.model = body["model"]
    return await send_json(state, request, ctx, "/messages/count_tokens", raw, read_usage=lambda _: None)


routes = [
    Route("/v1/messages", api_endpoint("messages", messages, ANTHROPIC), methods=["POST"]),
    Route(
        "/v1/messages/count_tokens", api_endpoint("messages_count_tokens", count_tokens, ANTHROPIC), methods=["POST"]
    ),
]
