"""Anthropic Messages: ``POST /v1/messages`` through the pipeline, ``/v1/messages/count_tokens`` forwarded.

Errors on these routes are in Anthropic's shape (``{"type": "error", "error": {...}}``), which
is what Anthropic SDKs raise typed exceptions for; the key may come as ``x-api-key``.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.app_state import ProxyState
from proxy.http import ANTHROPIC, RequestContext, parse_json_object, read_body
from proxy.protocols import MESSAGES, anthropic
from proxy.routes import compaction
from proxy.routes.exchange import Wire, send_json
from proxy.routes.forward import api_endpoint
from proxy.routes.pipeline import TurnOptions, forward_turn
from proxy.tenants import Tenant

COUNT_TOKENS = Wire("/messages/count_tokens", read_usage=lambda _: None)


async def messages(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    body = await compaction.read_messages(state, request, ctx, tenant)  # compaction items expanded
    if isinstance(body, Response):
        return body  # a compaction, answered by the proxy's summarizer (docs/compaction.md)
    compacted = await compaction.past_threshold(state, request, ctx, tenant, MESSAGES, body)
    if isinstance(compacted, Response):
        return compacted  # paused after compacting: the compaction is the answer
    body, diagnostics = MESSAGES.diagnostics_asked(compacted.body)
    view = MESSAGES.view(body, state.canonicalizer.tool_orders, tenant.name)
    options = TurnOptions(diagnostics=diagnostics)
    return compacted.deliver(await forward_turn(state, request, ctx, tenant, MESSAGES, view, options))


async def count_tokens(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    """Forwarded as sent: the count of what vLLM renders (canonicalization does not change it)."""
    raw = await read_body(request, state.settings.max_body_bytes)
    body = parse_json_object(raw)
    anthropic.validate_request(body, count_tokens=True)
    ctx.model = body["model"]
    return await send_json(state, request, ctx, COUNT_TOKENS, raw)


routes = [
    Route("/v1/messages", api_endpoint(MESSAGES.route, messages, ANTHROPIC), methods=["POST"]),
    Route(
        "/v1/messages/count_tokens", api_endpoint("messages_count_tokens", count_tokens, ANTHROPIC), methods=["POST"]
    ),
]
