"""POST /v1/chat/completions: the chat pipeline with the request as its own view."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.app_state import ProxyState
from proxy.backends import REFUSAL_STATUSES
from proxy.http import RequestContext
from proxy.protocols import CHAT_COMPLETIONS
from proxy.routes.forward import api_endpoint, new_context
from proxy.routes.pipeline import TurnOptions, forward_turn, read_request
from proxy.tenants import Tenant


async def chat_completions(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    body = await read_request(state, request, CHAT_COMPLETIONS, tenant)
    body, diagnostics = CHAT_COMPLETIONS.diagnostics_asked(body)
    view = CHAT_COMPLETIONS.view(body, state.canonicalizer.tool_orders, tenant.name)
    options = TurnOptions(diagnostics=diagnostics)
    response = await forward_turn(state, request, ctx, tenant, CHAT_COMPLETIONS, view, options)
    if (
        response.status_code in REFUSAL_STATUSES
        and ctx.restructured
        and not state.canonicalizer.keeps_structure(ctx.model)
    ):
        # Strict chat templates (Mistral's, Gemma's) refuse a system message after the first one.
        # Once such a refusal is cured by keeping the client's message order, it is kept for the model.
        state.canonicalizer.keep_structure(ctx.model)
        retry = new_context(request, CHAT_COMPLETIONS.route)
        retry.request_id, retry.tenant, retry.upstream_api_key = ctx.request_id, ctx.tenant, ctx.upstream_api_key
        retry.deadline = ctx.deadline
        retry.span, ctx.span = ctx.span, None  # one span for the client's request, ended with the retry
        retry.actions.append("retried_keeping_message_order")
        retry.shadow_accounted = True
        view = CHAT_COMPLETIONS.view(body, state.canonicalizer.tool_orders, tenant.name)
        response = await forward_turn(state, request, retry, tenant, CHAT_COMPLETIONS, view, options)
        if response.status_code in REFUSAL_STATUSES:
            state.canonicalizer.forget_structure(ctx.model)  # the request itself was the problem
    return response


routes = [Route("/v1/chat/completions", api_endpoint(CHAT_COMPLETIONS.route, chat_completions), methods=["POST"])]
