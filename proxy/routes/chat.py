"""POST /v1/chat/completions: authenticate, canonicalize, budget, forward, account."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.assistant import AssistantRecorder
from proxy.body import parse_json_object, read_body, validate_chat_request
from proxy.canon import CanonResult
from proxy.canon.fingerprint import stable_prefix_hash
from proxy.context import RequestContext
from proxy.errors import ProxyError
from proxy.forward import api_endpoint, error_response, new_context, send_json, send_stream, with_upstream_usage
from proxy.jsonio import dumps
from proxy.relay import SSERelay
from proxy.state import ProxyState
from proxy.tenants import Tenant
from proxy.turns import ChatTurn

ROUTE = "chat"


async def chat_completions(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
    validate_chat_request(body)
    response = await _forward(state, request, ctx, tenant, body)
    if response.status_code == 400 and ctx.restructured and not state.canonicalizer.keeps_structure(ctx.model):
        # Strict chat templates (Mistral's, Gemma's) refuse a system message after the first one.
        # Once such a refusal is cured by keeping the client's message order, it is kept for the model.
        state.canonicalizer.keep_structure(ctx.model)
        retry = new_context(request, ROUTE)
        retry.request_id, retry.tenant, retry.upstream_api_key = ctx.request_id, ctx.tenant, ctx.upstream_api_key
        retry.actions.append("retried_keeping_message_order")
        response = await _forward(state, request, retry, tenant, body)
        if response.status_code == 400:
            state.canonicalizer.forget_structure(ctx.model)  # the request itself was the problem
    return response


async def _forward(
    state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant, body: dict[str, Any]
) -> Response:
    turn: ChatTurn | None = None
    try:
        ctx.model = body["model"]
        ctx.stream = bool(body.get("stream"))

        canon = state.canonicalizer.apply(body, tenant.name)
        ctx.actions.extend(str(action) for action in canon.actions)
        ctx.prefix_hash = canon.prefix_hash
        ctx.saved_by_canonicalization = _count_canonicalization(state, body, canon)
        turn = await ChatTurn.begin(state, tenant, request.headers, body, canon)
        ctx.session_id = turn.session_id
        ctx.route_key = turn.routing_key
        ctx.actions.extend(turn.actions)
        forwarded = state.tenants.cache_salted(tenant, turn.forwarded)
        ctx.restructured = _roles(forwarded) != _roles(body)
        if state.settings.log_prompts:
            ctx.logged_messages = forwarded["messages"]

        if not ctx.stream:
            replies: list[dict[str, Any]] = []
            response = await send_json(
                state, request, ctx, "/chat/completions", dumps(forwarded), on_reply=replies.append
            )
            reply = _reply_message(replies[0]) if replies else None
            if reply is not None:
                _remember_tool_calls(state, tenant.name, forwarded, reply)
                await turn.finish(ctx.usage, reply.message())
            elif response.status_code >= 400:
                await turn.abandon()
            return response

        upstream_body, client_wants_usage = with_upstream_usage(forwarded)
        open_turn = turn

        def on_complete(relay: SSERelay) -> None:
            state.canonicalizer.record_reply(forwarded, tenant.name, relay.assistant.calls())
            open_turn.finish_later(relay.usage, relay.assistant.message())

        def on_incomplete(relay: SSERelay) -> None:
            state.sessions.spawn(open_turn.settle_unfinished(relay.usage, relay.events))

        response = await send_stream(
            state,
            request,
            ctx,
            "/chat/completions",
            dumps(upstream_body),
            client_wants_usage=client_wants_usage,
            on_complete=on_complete,
            on_incomplete=on_incomplete,
            record_content=turn.session is not None,
        )
        if response.status_code >= 400:
            await turn.abandon()
        return response
    except ProxyError as error:
        if turn is not None and error.status >= 500:
            await turn.abandon()
        return error_response(state, ctx, error)


def _roles(body: dict[str, Any]) -> list[Any]:
    return [m.get("role") if isinstance(m, dict) else None for m in body["messages"]]


routes = [Route("/v1/chat/completions", api_endpoint(ROUTE, chat_completions), methods=["POST"])]


def _count_canonicalization(state: ProxyState, body: dict[str, Any], canon: CanonResult) -> bool:
    """Count actions and prefix reuse; True when the prefix is reused only thanks to canonicalization.

    Then the client's own prefix was new, so without the rewrite the backend could not have served
    the cached tokens this request gets: they count as saved by canonicalization (an estimate).
    """
    for action in canon.actions:
        state.metrics.canon_actions.labels(action.kind).inc()
    seen = state.prefixes.hit(canon.prefix_hash)
    state.metrics.prefix_requests.labels("repeat" if seen else "new").inc()
    raw_prefix = stable_prefix_hash(body) if canon.changed else canon.prefix_hash
    raw_seen = state.prefixes.raw_seen(raw_prefix)
    return seen and not raw_seen


def _reply_message(reply: dict[str, Any]) -> AssistantRecorder | None:
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    recorder = AssistantRecorder()
    recorder.feed_message(choices[0].get("message"))
    return recorder


def _remember_tool_calls(state: ProxyState, tenant: str, forwarded: dict[str, Any], reply: AssistantRecorder) -> None:
    state.canonicalizer.record_reply(forwarded, tenant, reply.calls())
