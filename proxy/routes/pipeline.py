"""The chat pipeline, for chat completions and for a request held in another protocol (Anthropic
Messages, Responses).

The protocol module gives a chat-shaped *view* of the request (for chat completions, the request
itself); the view goes through canonicalization, session, summary, budgets and accounting, and the
canonical view is mapped back onto the client's body, which is what the backend receives, in the
client's protocol. The backend's answer reaches the client unchanged; its usage and the assistant's
reply are read in the protocol's own terms, and a turn ends the same way streamed or not.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from itertools import compress, count
from operator import is_not
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy.app_state import ProxyState
from proxy.backends import REFUSAL_STATUSES, context_overflow, error_of
from proxy.canon import CanonResult, stable_prefix_hash
from proxy.chat import ChatTurn
from proxy.http import ProxyError, RequestContext, ServerError, parse_json_object, read_body
from proxy.openai import AssistantRecorder, Usage, dumps_body
from proxy.protocols import DiagnosticsAsk, GenerationProtocol, ProtocolView
from proxy.routes.exchange import StreamingAnswer, UpstreamAnswer, WholeAnswer, Wire, respond, send
from proxy.routes.forward import error_response
from proxy.routes.observe import (
    Observed,
    after_answer,
    before_upstream,
    diagnose,
    needs_reply_content,
    remember_answer,
)
from proxy.routes.shadowing import rewrite_or_forward
from proxy.tenants import Tenant

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
    # The client asked for cache diagnostics (``GenerationProtocol.diagnostics_asked``).
    diagnostics: DiagnosticsAsk | None = None


async def read_request(
    state: ProxyState, request: Request, protocol: GenerationProtocol, tenant: Tenant
) -> dict[str, Any]:
    """The client's body as a JSON object the protocol accepts (InvalidRequest otherwise)."""
    body = parse_json_object(await read_body(request, state.settings.max_body_bytes), tenant.name)
    protocol.validate(body, tenant.name)
    return body


def wire_of(protocol: GenerationProtocol) -> Wire:
    return Wire(protocol.path, protocol.read_usage, protocol.relay_class, protocol.answer_list)


class TurnEnding:
    """How one turn ends, whole or streamed: :meth:`completed`, :meth:`cut_short` or :meth:`failed`.

    What the client's next request must find is recorded at once (the reply the backend cached,
    the cache-break observation); the session's side (its record, budget settlement, summary upkeep)
    is :meth:`record`, the first step after the response (``proxy.routes.forward.after_response``),
    or before the response where a shared store must hold it first."""

    def __init__(
        self,
        state: ProxyState,
        ctx: RequestContext,
        turn: ChatTurn,
        protocol: GenerationProtocol,
        chat: dict[str, Any],
        on_answer: AnswerHook | None,
    ) -> None:
        self._state, self._ctx, self._turn, self._protocol = state, ctx, turn, protocol
        self._chat, self._on_answer = chat, on_answer
        self._forwarded = turn.forwarded
        # The cache-break observation of the request as forwarded (``before_upstream``), if any.
        self.observed: Observed | None = None
        self._pending: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._whole_answer: dict[str, Any] | None = None
        # No answer came (an error, or an answer without a reply): what was reserved goes back
        # before the client hears of it (it may retry at once, or the route resend it).
        self._unanswered = False

    def completed(self, answer: UpstreamAnswer) -> None:
        if isinstance(answer, StreamingAnswer):
            relay = answer.relay
            self._conclude(relay.assistant, relay.usage, relay.answer_id)
            self._pending.append(partial(self._turn.finish, relay.usage, relay.assistant.message()))
            if relay.answer is not None:
                self._answered(relay.answer)
            return
        reply = self._protocol.reply_of(answer.parsed) if answer.ok else None
        if reply is None:
            self._pending.append(self._turn.abandon)
            self._unanswered = True
            return
        self._conclude(reply, answer.usage, answer.parsed.get("id") if answer.parsed else None)
        self._whole_answer = answer.parsed
        self._pending.append(partial(self._turn.finish, answer.usage, reply.message()))

    async def before_response(self) -> None:
        """What must be recorded before the client has a whole answer: the answer itself where the
        client may refer to it the moment it has it (a stored response), and the turn where the
        store is shared. An in-process store records the turn right after the answer, before
        anything else the proxy serves; a shared one (another replica may serve the next turn)
        is written first."""
        if self._whole_answer is not None and self._on_answer is not None:
            await self._on_answer(self._whole_answer, self._ctx.backend)
        if self._unanswered or not self._state.sessions.store.in_process:
            await self.record()

    def cut_short(self, usage: Usage | None, events: int) -> None:
        self._pending.append(partial(self._turn.settle_unfinished, usage, events * self._turn.tokens_per_event))

    def failed(self, error: ProxyError | None) -> None:
        """No answer: the reserved tokens go back (a client's own error reserved nothing to keep)."""
        if error is None or isinstance(error, ServerError):
            self._pending.append(self._turn.abandon)
        self._unanswered = True

    def answer_named(self, answer: dict[str, Any]) -> None:
        """A stream named its answer before it ended (Responses' ``response.created``): recorded
        now, a client that refers to it the moment the stream ends finds it."""
        self._answered(answer)

    async def record(self) -> None:
        pending, self._pending = self._pending, []
        for step in pending:
            await step()

    def _conclude(self, reply: AssistantRecorder, usage: Usage | None, answer_id: Any) -> None:
        self._state.canonicalizer.record_reply(self._forwarded, self._ctx.tenant, reply.calls())
        remember_answer(self._state, self._ctx, answer_id if isinstance(answer_id, str) else None)
        if self.observed is not None:
            after_answer(self._state, self._ctx, self.observed, self._chat, reply.message(), usage)

    def _answered(self, answer: dict[str, Any]) -> None:
        if self._on_answer is not None:
            self._state.sessions.spawn(self._on_answer(answer, self._ctx.backend))


async def forward_turn(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    tenant: Tenant,
    protocol: GenerationProtocol,
    view: ProtocolView,
    options: TurnOptions | None = None,
) -> Response:
    """One turn of a conversation in ``protocol``: canonicalized, admitted, sent, answered."""
    options = options or TurnOptions()
    ending: TurnEnding | None = None
    chat = view.chat
    try:
        ctx.model = chat["model"]
        ctx.stream = bool(chat.get("stream"))
        canon = canonicalize(state, ctx, tenant, view)
        turn = await ChatTurn.begin(
            state.turn_services,
            state.settings,
            tenant,
            request.headers,
            chat,
            canon,
            channel=protocol.channel(view),
            summarize=options.summarize,
            history_tokens=options.history_tokens,
            session_id=options.session_id,
        )
        ending = TurnEnding(state, ctx, turn, protocol, chat, options.on_answer)
        ctx.session_id = turn.session_id
        ctx.route_key = turn.routing_key
        ctx.actions.extend(turn.actions)
        answer_fields = None
        unsalted = False  # sent again without the cache_salt the engine refused
        for attempt in range(2):
            forwarded = turn.forwarded
            outgoing = state.tenants.cache_salted(tenant, view.restore(forwarded))
            if unsalted:
                outgoing = {name: value for name, value in outgoing.items() if name != "cache_salt"}
            if protocol.path == "/chat/completions" and (slot := await turn.summary_slot()) is not None:
                # llama-server: the first turn carrying a new summary keeps to its conversation's slot.
                outgoing = {**outgoing, "id_slot": slot}
                ctx.actions.append(f"slot_named:{slot}")
            ctx.restructured = _restructured(forwarded["messages"], chat["messages"])
            if state.settings.log_prompts:
                ctx.logged_messages = forwarded["messages"]
            # Explained in chat shape for every protocol (what the digests read); not a request whose
            # history the backend holds (a Responses chain): its view is the new turn alone.
            if options.summarize:
                ending.observed = before_upstream(state, ctx, turn, forwarded)
            if options.diagnostics is not None and answer_fields is None:
                answer_fields = protocol.diagnostics_fields(diagnose(state, ctx, turn, view, options.diagnostics))
            client_wants_usage = True
            if ctx.stream:
                outgoing, client_wants_usage = protocol.stream_request(outgoing)
            answer = await send(
                state,
                request,
                ctx,
                wire_of(protocol),
                dumps_body(outgoing),
                stream=ctx.stream,
                backend=options.backend,
                client_wants_usage=client_wants_usage,
                record_content=turn.session is not None or (ending.observed is not None and needs_reply_content(state)),
                on_answer=ending.answer_named,
                answer_fields=answer_fields,
            )
            if not attempt and "cache_salt" in outgoing and _salt_refused(answer):
                # An engine that takes no cache_salt (vLLM before 0.6.5, or on its V0 engine): the turn
                # is sent again without the salt the proxy added; only if the engine then takes it is
                # the salt left out for this model from now on (an error a tenant provoked that merely
                # quotes the field's name must not switch isolation off for every tenant).
                unsalted = True
                ctx.actions.append("resent_without_cache_salt")
                ctx.upstream_over()
                continue
            if unsalted and (isinstance(answer, StreamingAnswer) or answer.status < 400):
                state.tenants.refuses_salt(str(outgoing.get("model")))
            # The engine refused the prompt as past its context: compacted and sent once more, before
            # anything reached the client (never a context error the engine would not have given).
            if attempt or not _past_context(state, ctx.model, answer) or not await turn.compact_for_engine():
                break
            ctx.actions.append("compacted_for_engine_context")
            ctx.upstream_over()
        if not isinstance(answer, StreamingAnswer):
            ending.completed(answer)  # a stream's ending is told when the stream ends
            await ending.before_response()
        return respond(state, ctx, answer, ending)
    except ProxyError as error:
        if ending is not None:
            ending.failed(error)
            await ending.before_response()
        return error_response(state, ctx, error, ending)


def canonicalize(state: ProxyState, ctx: RequestContext, tenant: Tenant, view: ProtocolView) -> CanonResult:
    """The view canonicalized, its actions and prefix recorded on ``ctx`` and counted."""
    canon = rewrite_or_forward(state, ctx, view.chat, tenant.name)
    ctx.actions.extend(view.actions)
    ctx.actions.extend(str(action) for action in canon.actions)
    ctx.prefix_hash = canon.prefix_hash
    ctx.saved_by_canonicalization = count_canonicalization(state, tenant.name, view.chat, canon)
    return canon


# How an engine refuses the field itself: pydantic's error for an unknown field (the field's name
# on a line of its own, then "Extra inputs are not permitted"), vLLM's check_cache_salt_support.
_SALT_REFUSAL = re.compile(
    r"(?m)^\s*cache_salt\s*$\s*^\s*Extra inputs are not permitted|Parameter 'cache_salt' is not supported"
)


def _salt_refused(answer: UpstreamAnswer) -> bool:
    """Whether the engine refused the request for its ``cache_salt`` field (an unknown field, or one
    its engine does not support), in the words engines refuse a field with."""
    if not isinstance(answer, WholeAnswer) or answer.status not in REFUSAL_STATUSES:
        return False
    error = error_of(answer.raw)
    return error is not None and _SALT_REFUSAL.search(error[0]) is not None


def _past_context(state: ProxyState, model: str | None, answer: UpstreamAnswer) -> bool:
    """Whether the engine refused the prompt for its context; the context it stated, learned."""
    overflow = context_overflow(answer.status, answer.raw) if isinstance(answer, WholeAnswer) else None
    if overflow is not None and overflow.context is not None and model:
        state.models.learn_context(model, overflow.context)
    return overflow is not None


def _restructured(forwarded: list[Any], sent: list[Any]) -> bool:
    """Whether the roles of the messages forwarded differ from the client's (a message inserted,
    or replaced by one of another role): only the messages that are not the client's own objects
    are read."""
    if len(forwarded) != len(sent):
        return True
    if forwarded == sent:
        return False  # equal messages have equal roles (the same objects compared without a look inside)
    changed = compress(count(), map(is_not, forwarded, sent))
    return any(_role(forwarded[index]) != _role(sent[index]) for index in changed)


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


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
