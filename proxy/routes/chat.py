"""POST /v1/chat/completions: the chat pipeline with the request as its own view."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.app_state import ProxyState
from proxy.http.body import parse_json_object, read_body, validate_chat_request
from proxy.http.context import RequestContext
from proxy.http.relay import SSERelay
from proxy.openai.assistant import AssistantRecorder
from proxy.openai.usage import Usage
from proxy.protocols.channel import CHAT
from proxy.routes.forward import api_endpoint, new_context, with_upstream_usage
from proxy.routes.pipeline import ProtocolRoute, forward_turn
from proxy.tenants import Tenant

ROUTE = "chat"


@dataclass
class ChatView:
    """A chat completions request is its own chat view; the canonical view is what is sent."""

    chat: dict[str, Any]
    actions: list[str] = field(default_factory=list)

    def restore(self, forwarded: dict[str, Any]) -> dict[str, Any]:
        return forwarded


def reply_message(reply: dict[str, Any]) -> AssistantRecorder | None:
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    recorder = AssistantRecorder()
    recorder.feed_message(choices[0].get("message"))
    return recorder


CHAT_COMPLETIONS = ProtocolRoute(
    path="/chat/completions",
    relay_class=SSERelay,
    read_usage=Usage.from_openai,
    reply_of=reply_message,
    channel=lambda view: CHAT,
    stream_request=with_upstream_usage,
    observed=True,
)


async def chat_completions(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
    validate_chat_request(body)
    response = await forward_turn(state, request, ctx, tenant, ChatView(body), CHAT_COMPLETIONS)
    if response.status_code == 400 and ctx.restructured and not state.canonicalizer.keeps_structure(ctx.model):
        # Strict chat templates (Mistral's, Gemma's) refuse a system message after the first one.
        # Once such a refusal is cured by keeping the client's message order, it is kept for the model.
        state.canonicalizer.keep_structure(ctx.model)
        retry = new_context(request, ROUTE)
        retry.request_id, retry.tenant, retry.upstream_api_key = ctx.request_id, ctx.tenant, ctx.upstream_api_key
        retry.deadline = ctx.deadline
        retry.span, ctx.span = ctx.span, None  # one span for the client's request, ended with the retry
        retry.actions.append("retried_keeping_message_order")
        response = await forward_turn(state, request, retry, tenant, ChatView(body), CHAT_COMPLETIONS)
        if response.status_code == 400:
            state.canonicalizer.forget_structure(ctx.model)  # the request itself was the problem
    return response


routes = [Route("/v1/chat/completions", api_endpoint(ROUTE, chat_completions), methods=["POST"])]
