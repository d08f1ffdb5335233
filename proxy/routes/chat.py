"""POST /v1/chat/completions: the pipeline that makes prefixes stable."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from proxy.assistant import AssistantRecorder
from proxy.body import parse_json_object, read_body, validate_chat_request
from proxy.canon import CanonResult
from proxy.errors import ProxyError
from proxy.forward import dumps, error_response, new_context, send_json, send_stream
from proxy.relay import SSERelay
from proxy.state import ProxyState, get_state

router = APIRouter()
ROUTE = "chat"


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    ctx = new_context(request, ROUTE)
    try:
        body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
        validate_chat_request(body)
        ctx.model = body["model"]
        ctx.stream = bool(body.get("stream"))

        canon = state.canonicalizer.apply(body, ctx.tenant)
        ctx.actions = [str(action) for action in canon.actions]
        ctx.prefix_hash = canon.prefix_hash
        _count_canonicalization(state, canon)

        forwarded = canon.body
        if not ctx.stream:
            return await send_json(
                state,
                request,
                ctx,
                "/chat/completions",
                dumps(forwarded),
                on_reply=lambda reply: _remember_reply(state, ctx.tenant, forwarded, reply),
            )
        client_wants_usage = _client_wants_usage(forwarded)
        forwarded = {
            **forwarded,
            "stream_options": {**(forwarded.get("stream_options") or {}), "include_usage": True},
        }
        return await send_stream(
            state,
            request,
            ctx,
            "/chat/completions",
            dumps(forwarded),
            client_wants_usage=client_wants_usage,
            on_complete=lambda relay: _remember_stream(state, ctx.tenant, forwarded, relay),
        )
    except ProxyError as error:
        return error_response(state, ctx, error)


def _client_wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _count_canonicalization(state: ProxyState, canon: CanonResult) -> None:
    for action in canon.actions:
        state.metrics.canon_actions.labels(action.kind).inc()
    seen = state.prefixes.hit(canon.prefix_hash)
    state.metrics.prefix_requests.labels("repeat" if seen else "new").inc()


def _remember_reply(state: ProxyState, tenant: str, forwarded: dict[str, Any], reply: dict[str, Any]) -> None:
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return
    recorder = AssistantRecorder()
    recorder.feed_message(choices[0].get("message"))
    state.canonicalizer.record_reply(forwarded, tenant, recorder.calls())


def _remember_stream(state: ProxyState, tenant: str, forwarded: dict[str, Any], relay: SSERelay) -> None:
    state.canonicalizer.record_reply(forwarded, tenant, relay.assistant.calls())
