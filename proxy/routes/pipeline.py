"""The chat pipeline, for chat completions and for a request held in another protocol (Anthropic
Messages, Responses).

The protocol module gives a chat-shaped *view* of the request (for chat completions, the request
itself); the view goes through canonicalization, session, summary, budgets and accounting, and the
canonical view is mapped back onto the client's body, which is what the backend receives, in the
client's protocol. The backend's answer reaches the client unchanged; its usage and the assistant's
reply are read in the protocol's own terms, and a turn ends the same way streamed or not.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from proxy.app_state import ProxyState
from proxy.canon import CanonResult
from proxy.canon.fingerprint import stable_prefix_hash
from proxy.chat.turn import ChatTurn
from proxy.http.context import RequestContext
from proxy.http.errors import ProxyError, ServerError
from proxy.http.relay import SSERelay
from proxy.http.streaming import RelayResponse
from proxy.openai.assistant import AssistantRecorder
from proxy.openai.jsonio import dumps
from proxy.openai.usage import Usage
from proxy.protocols.channel import SummaryChannel
from proxy.routes.forward import UsageReader, after_sending, error_response, send_json, send_stream
from proxy.routes.observe import after_answer, before_upstream, needs_reply_content
from proxy.tenants import Tenant


class ProtocolView(Protocol):
    """A request seen as chat: ``chat`` is the view, ``restore`` maps a canonical view back."""

    chat: dict[str, Any]
    actions: list[str]

    def restore(self, forwarded: dict[str, Any]) -> dict[str, Any]: ...


@dataclass
class ProtocolRoute:
    """How one protocol's generation endpoint talks to the backend."""

    path: str
    relay_class: Callable[..., SSERelay]
    read_usage: UsageReader
    reply_of: Callable[[Any], AssistantRecorder | None]
    channel: Callable[[Any], SummaryChannel]
    # A stream request as sent upstream (asking for usage if the protocol makes that optional), and
    # whether the client asked for the usage itself.
    stream_request: Callable[[dict[str, Any]], tuple[dict[str, Any], bool]] = field(default=lambda body: (body, True))
    # Explain cache misses against earlier prompts and capture traffic (docs/analysis.md), on the
    # request's chat-shaped view.
    observed: bool = False


# Told the backend's answer (its header as soon as a stream names it, the whole answer at the end)
# and the backend that gave it.
AnswerHook = Callable[[dict[str, Any], str | None], Coroutine[Any, Any, None]]


@dataclass
class TurnOptions:
    """Per-request extras: the backend the request must go to (it holds state the request refers
    to), and what to do with the backend's answer; for a request whose history the backend holds,
    no summary and the history's size for the budgets."""

    backend: str | None = None
    on_answer: AnswerHook | None = None
    summarize: bool = True
    history_tokens: int = 0
    # The session the request belongs to, known to the proxy (a Responses chain's).
    session_id: str | None = None


async def forward_turn(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    tenant: Tenant,
    view: ProtocolView,
    route: ProtocolRoute,
    options: TurnOptions | None = None,
) -> Response:
    options = options or TurnOptions()
    turn: ChatTurn | None = None
    chat = view.chat
    try:
        ctx.model = chat["model"]
        ctx.stream = bool(chat.get("stream"))
        canon = state.canonicalizer.apply(chat, tenant.name)
        ctx.actions.extend(view.actions)
        ctx.actions.extend(str(action) for action in canon.actions)
        ctx.prefix_hash = canon.prefix_hash
        ctx.saved_by_canonicalization = count_canonicalization(state, tenant.name, chat, canon)
        turn = await ChatTurn.begin(
            state,
            tenant,
            request.headers,
            chat,
            canon,
            channel=route.channel(view),
            summarize=options.summarize,
            history_tokens=options.history_tokens,
            session_id=options.session_id,
        )
        ctx.session_id = turn.session_id
        ctx.route_key = turn.routing_key
        ctx.actions.extend(turn.actions)
        forwarded_view = turn.forwarded
        outgoing = state.tenants.cache_salted(tenant, view.restore(forwarded_view))
        ctx.restructured = _roles(forwarded_view) != _roles(chat)
        if state.settings.log_prompts:
            ctx.logged_messages = forwarded_view["messages"]
        # Explained in chat shape for every protocol (what the digests read); not a request whose
        # history the backend holds (a Responses chain): its view is the new turn alone.
        observe = route.observed and options.summarize
        observed = before_upstream(state, ctx, turn, forwarded_view) if observe else None

        answers: list[dict[str, Any]] = []
        open_turn = turn
        hook = options.on_answer

        def answered(answer: dict[str, Any]) -> None:
            if hook is not None:
                state.sessions.spawn(hook(answer, ctx.backend))

        def conclude(reply: AssistantRecorder, usage: Usage | None) -> None:
            """What an answered turn records at once, streamed or not (before the client can send
            its next request)."""
            state.canonicalizer.record_reply(forwarded_view, tenant.name, reply.calls())
            if observed is not None:
                after_answer(state, ctx, observed, chat, reply.message(), usage)

        if ctx.stream:
            upstream_body, client_wants_usage = route.stream_request(outgoing)

            def on_complete(relay: SSERelay) -> None:
                conclude(relay.assistant, relay.usage)
                open_turn.finish_later(relay.usage, relay.assistant.message())
                if relay.answer is not None:
                    answered(relay.answer)

            def on_incomplete(relay: SSERelay) -> None:
                state.sessions.spawn(open_turn.settle_unfinished(relay.usage, relay.events))

            response = await send_stream(
                state,
                request,
                ctx,
                route.path,
                dumps(upstream_body),
                client_wants_usage=client_wants_usage,
                on_complete=on_complete,
                on_incomplete=on_incomplete,
                record_content=turn.session is not None or (observed is not None and needs_reply_content(state)),
                on_reply=answers.append,
                relay_class=partial(route.relay_class, on_answer=answered),
                read_usage=route.read_usage,
                backend=options.backend,
            )
            if isinstance(response, RelayResponse):
                return response
        else:
            response = await send_json(
                state,
                request,
                ctx,
                route.path,
                dumps(outgoing),
                on_reply=answers.append,
                read_usage=route.read_usage,
                backend=options.backend,
            )
        # A JSON answer (also when the upstream answered a stream request with one).
        reply = route.reply_of(answers[0]) if answers else None
        if reply is None:
            await turn.abandon()
            return response
        conclude(reply, ctx.usage)
        if hook is not None:
            await hook(answers[0], ctx.backend)  # before the client can refer to it
        finish = partial(turn.finish, ctx.usage, reply.message())
        if state.sessions.store.in_process:
            # The client's next request must find this turn recorded. An in-process store records
            # it without waiting, so nothing the proxy serves can come between the answer and the
            # record, and the client need not wait for it; a shared store must be written first.
            after_sending(response, finish)
        else:
            await finish()
        return response
    except ProxyError as error:
        if turn is not None and isinstance(error, ServerError):
            await turn.abandon()
        return error_response(state, ctx, error)


def _roles(body: dict[str, Any]) -> list[Any]:
    return [m.get("role") if isinstance(m, dict) else None for m in body["messages"]]


def count_canonicalization(state: ProxyState, tenant: str, body: dict[str, Any], canon: CanonResult) -> bool:
    """Count actions and prefix reuse; True when the prefix is reused only thanks to canonicalization.

    Then the client's own prefix was new, so without the rewrite the backend could not have served
    the cached tokens this request gets: they count as saved by canonicalization (an estimate).

    Prefixes are remembered per tenant: "seen before" must mean seen from the same tenant, or the
    ``reuse`` counter would tell one tenant whether another had sent a system prompt it guessed
    (and tenants do not share cached blocks anyway: each has its own cache salt).
    """
    for action in canon.actions:
        state.metrics.canon_actions.labels(action.kind).inc()
    seen = state.prefixes.hit(_per_tenant(tenant, canon.prefix_hash))
    state.metrics.prefix_requests.labels("repeat" if seen else "new").inc()
    raw_prefix = stable_prefix_hash(body) if canon.changed else canon.prefix_hash
    raw_seen = state.prefixes.raw_seen(_per_tenant(tenant, raw_prefix))
    return seen and not raw_seen


def _per_tenant(tenant: str, prefix_hash: str) -> str:
    return f"{tenant}\x1f{prefix_hash}"
