"""Compaction a client asks for, served by the proxy's summarizer (docs/compaction.md).

vLLM has no compaction: it refuses Responses' ``compaction`` and ``compaction_trigger`` items and
Anthropic's ``compaction`` blocks, has no ``/v1/responses/compact`` and drops Anthropic's
``compaction`` parameter. The proxy serves them itself:

- ``POST /v1/responses`` whose last input item is a ``compaction_trigger`` (what Codex sends with
  ``remote_compaction = "v2"``): a Response (or its event stream) with exactly one ``compaction``
  output item;
- ``POST /v1/responses/compact``: a ``response.compaction`` with the request's user messages and
  one ``compaction`` item;
- ``POST /v1/messages`` with ``compaction: {"type": "summarize"}``: a Message holding one
  ``compaction`` block, ``stop_reason`` ``compaction``;
- a turn whose ``context_management`` asks for compaction past a threshold (Responses'
  ``compaction`` entry, Anthropic's ``compact_20260112`` edit) and reaches it: the history before
  its last turn summarized, the turn answered on the summary and that turn, the compaction item
  first in the answer (:func:`past_threshold`).

The summary is one request to the conversation's backend: the request's conversation, converted
and canonicalized as a turn of it is, plus the instruction (``CompactionService.
summarize_conversation``), so its prefix is the one the conversation left in the cache. The item
holds the summary, sealed for the tenant (``proxy.chat.handoff``); sent back, it is expanded into
the same summary message on every turn (``proxy.protocols.compaction``) before the request is
validated, and the pipeline sees ordinary messages. A summary that fails is the protocol's error
(502/504), never a made-up item.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from proxy.app_state import ProxyState
from proxy.backends import refuses_answer_room
from proxy.canon import CanonResult
from proxy.chat import budget_for, context_limit, handoff, routing_key, usage_limits
from proxy.http import InvalidRequest, ProxyError, RequestContext, overhead_header, parse_json_object, read_body
from proxy.openai import Usage, dumps, loads
from proxy.protocols import MESSAGES, RESPONSES, GenerationProtocol
from proxy.protocols import compaction as wire
from proxy.routes.forward import after_response, api_endpoint, proxy_headers, upstream_headers
from proxy.routes.pipeline import canonicalize
from proxy.sessions import StoreUnavailable
from proxy.tenants import Tenant
from summarizer import DEFAULT_INSTRUCTION

logger = logging.getLogger("prefix_proxy.compaction")

Expand = Callable[[dict[str, Any], wire.Unseal], tuple[dict[str, Any], int]]


# -- the handlers' entry points ----------------------------------------------------------------


async def read_responses(
    state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant
) -> dict[str, Any] | Response:
    """A ``POST /v1/responses`` body, its compaction items expanded and validated; or, for a
    request ending in a ``compaction_trigger``, the proxy's answer to it (a :class:`Response`)."""
    body = await _read(state, request, tenant)
    body = _expanded(state, ctx, tenant, RESPONSES, body, wire.expand_responses)
    if not wire.is_trigger_request(body):
        RESPONSES.validate(body)
        return body
    body = wire.without_trigger(body)
    _no_chain(body)
    RESPONSES.validate(body)
    text, usage = await _summarize(state, request, ctx, tenant, RESPONSES, body, None)
    token = _seal(state, tenant, text, usage)
    answer = wire.responses_answer(body, _id("resp_"), int(time.time()), [wire.compaction_item(token)], usage)
    if body.get("stream"):
        return _answer(state, ctx, wire.responses_events(answer), "text/event-stream")
    return _answer(state, ctx, dumps(answer), "application/json")


async def read_messages(
    state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant
) -> dict[str, Any] | Response:
    """A ``POST /v1/messages`` body, its compaction blocks expanded and validated; or, for a
    request with ``compaction: {"type": "summarize"}``, the proxy's answer to it."""
    body = await _read(state, request, tenant)
    body = _expanded(state, ctx, tenant, MESSAGES, body, wire.expand_messages)
    param = wire.compaction_param(body)
    if param is None:
        MESSAGES.validate(body, tenant.name)
        return body
    body = {key: value for key, value in body.items() if key != "compaction"}
    MESSAGES.validate(body, tenant.name)
    text, usage = await _summarize(state, request, ctx, tenant, MESSAGES, body, wire.compaction_instruction(param))
    token = _seal(state, tenant, text, usage)
    return _compaction_message(state, ctx, body, text, token, usage)


async def compact(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    """``POST /v1/responses/compact``: the request's user messages, then one compaction item."""
    body = await _read(state, request, tenant)
    original = body.get("input")
    body = _expanded(state, ctx, tenant, RESPONSES, body, wire.expand_responses)
    _no_chain(body)
    if wire.is_trigger_request(body):
        body = wire.without_trigger(body)
    RESPONSES.validate(body)
    # A compaction is never streamed, whatever the body says.
    body = {key: value for key, value in body.items() if key != "stream"}
    text, usage = await _summarize(state, request, ctx, tenant, RESPONSES, body, None)
    token = _seal(state, tenant, text, usage)
    output = [*wire.retained_user_items(original), wire.compaction_item(token)]
    answer = wire.compacted_response(_id("resp_"), int(time.time()), output, usage)
    return _answer(state, ctx, dumps(answer), "application/json")


@dataclass
class Compacted:
    """A turn's body, compacted where its ``context_management`` asked and its threshold was
    reached; :meth:`deliver` puts the compaction item first in the turn's answer."""

    body: dict[str, Any]
    _patch: Callable[[Response], Response] | None = None

    def deliver(self, response: Response) -> Response:
        return self._patch(response) if self._patch is not None else response


async def past_threshold(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    tenant: Tenant,
    protocol: GenerationProtocol,
    body: dict[str, Any],
) -> Compacted | Response:
    """A turn asking to be compacted past a threshold (``context_management``), as the hosted APIs
    do it: at or past it, the history before the client's last turn is summarized (the request
    the conversation's prefix hits, as on demand) and the turn answered on the summary and that
    turn, which is what the compaction item expands to on the next request (then everything
    before it is dropped). Below it, or with nothing before the last turn, the turn goes as sent.

    The input is counted by the proxy's tokenizer (tiktoken, not the model's: an estimate). A
    threshold left unset (OpenAI's ``compact_threshold``) is the model's context budget. Anthropic's
    ``pause_after_compaction`` answers the compaction alone (``stop_reason`` ``compaction``)."""
    responses = protocol is RESPONSES
    body, ask = wire.responses_auto_compaction(body) if responses else wire.messages_auto_compaction(body)
    key = "input" if responses else "messages"
    items = body.get(key)
    # A previous_response_id chain's history is the backend's: nothing here to compact.
    if ask is None or not isinstance(items, list) or body.get("previous_response_id") is not None:
        return Compacted(body)
    start = wire.responses_turn_start(items) if responses else wire.messages_turn_start(items)
    earlier = [item for item in items[:start] if not wire.is_instruction(item)]
    # Nothing before the last turn, or only the summary it already has (an agent's loop of calls in
    # one turn past the threshold): another summary would only recompute the turn.
    if all(wire.is_summary_message(item) for item in earlier):
        return Compacted(body)
    chat = protocol.view(body, state.canonicalizer.tool_orders, tenant.name).chat
    threshold = ask.threshold if ask.threshold is not None else await _default_threshold(state, tenant, chat)
    counter = state.token_counter
    if (
        threshold is None
        or counter.count_messages(chat["messages"]) + counter.count_tools(chat.get("tools")) < threshold
    ):
        return Compacted(body)
    if await _budget_spent(state, tenant, str(chat["model"]), state.sessions.explicit_id(request.headers, chat)):
        return Compacted(body)  # the turn is refused (429): a summary now would be charged for nothing
    history = {key: value for key, value in body.items() if key != "stream"}
    history[key] = items[:start]
    # Paused, the compaction is the answer: its usage is the request's, as on demand.
    before_turn = not ask.pause
    try:
        text, usage = await _summarize(
            state, request, ctx, tenant, protocol, history, ask.instruction, before_turn=before_turn
        )
    except ProxyError as error:
        # The turn can still be answered as sent: a failed summary costs the client its compaction, not the turn.
        logger.warning("compaction past the threshold failed (%s): the turn goes as sent", error.code or error.status)
        ctx.actions.append("compaction_failed")
        if not before_turn:
            ctx.upstream_over()
        return Compacted(body)
    token = _seal(state, tenant, text, usage, kept=items[start:])
    unseal = unsealer(state, tenant)
    if responses:
        item = wire.compaction_item(token)
        # Exactly what the item expands to when it comes back after this turn's input.
        compacted, _ = wire.expand_responses({**body, "input": [*items, item]}, unseal)
        whole = partial(wire.responses_with_item, item=item)
        return Compacted(compacted, partial(_patched, whole=whole, stream=wire.ResponsesItemFirst(item)))
    block = wire.compaction_block(text, token)
    if ask.pause:
        return _compaction_message(state, ctx, body, text, token, usage)
    compacted, _ = wire.expand_messages(
        {**body, "messages": [*items, {"role": "assistant", "content": [block]}]}, unseal
    )
    whole = partial(wire.messages_with_block, block=block, usage=usage)
    return Compacted(compacted, partial(_patched, whole=whole, stream=wire.MessagesBlockFirst(block, usage)))


async def _budget_spent(state: ProxyState, tenant: Tenant, model: str, session: str | None) -> bool:
    """Whether a usage budget of the request (the tenant's, the session's) is spent already."""
    settings = state.settings
    budget = budget_for(settings, model, tenant.budget)
    sessions = state.sessions
    for limit in usage_limits(budget, tenant.name, session):
        try:
            used = await sessions.used(limit, budget.window_s)
        except StoreUnavailable:
            return False  # admitted as the turn is: the store's outage is never the client's
        if used >= limit.limit:
            return True
    return False


async def _default_threshold(state: ProxyState, tenant: Tenant, chat: dict[str, Any]) -> int | None:
    """The model's context budget, less room for the summary: the summary request is the history
    and the instruction, and must fit with its answer."""
    model = str(chat.get("model"))
    settings = state.settings
    budget = budget_for(settings, model, tenant.budget)
    answer_room = refuses_answer_room(state.models.engine(model))
    limit = context_limit(budget, await state.models.max_model_len(model), chat, answer_room=answer_room)
    return None if limit is None else max(1, limit - settings.summarizer.max_summary_tokens - SUMMARY_INSTRUCTION_ROOM)


# Tokens the summary instruction takes, at most (the default is about 70).
SUMMARY_INSTRUCTION_ROOM = 256


def _patched(
    response: Response, *, whole: Callable[[dict[str, Any]], dict[str, Any]], stream: Callable[[bytes], bytes]
) -> Response:
    """The turn's answer with the compaction first: a whole one rewritten, a stream's events as
    they pass. An error answer goes as it came (the compaction it followed is not lost to the
    client: it sends the same turn again, and it is compacted again)."""
    if response.status_code != 200:
        return response
    if isinstance(response, StreamingResponse):
        inner = response.body_iterator

        async def shifted() -> AsyncIterator[bytes]:
            async for chunk in inner:
                yield stream(chunk.encode() if isinstance(chunk, str) else bytes(chunk))

        response.body_iterator = shifted()
        return response
    try:
        answer = loads(bytes(response.body))
    except ValueError:
        return response
    if isinstance(answer, dict):
        response.body = dumps(whole(answer))
        response.headers["content-length"] = str(len(response.body))
    return response


# -- the work ----------------------------------------------------------------------------------


async def _read(state: ProxyState, request: Request, tenant: Tenant) -> dict[str, Any]:
    return parse_json_object(await read_body(request, state.settings.max_body_bytes), tenant.name)


def _seal(state: ProxyState, tenant: Tenant, summary: str, usage: Usage | None, kept: list[Any] | None = None) -> str:
    """The compaction token of ``summary`` for ``tenant``. The first one sealed with a key of this
    process's own (no ``cache_salt_secret``, no shared store) says, once, that it will not open
    after a restart or on another replica."""
    salt_key = state.tenants.salt_key
    if salt_key.source == "process" and not salt_key.told_unshared:
        salt_key.told_unshared = True
        logger.warning(
            "compaction items are sealed with this process's own key: they stop opening after a restart "
            "and on other replicas (set cache_salt_secret, or use the Redis store)"
        )
    return handoff.seal(salt_key.secret, tenant.name, summary, usage.completion_tokens if usage else 0, kept)


def unsealer(state: ProxyState, tenant: Tenant) -> wire.Unseal:
    """What opens the compaction tokens of ``tenant``'s requests."""
    return partial(handoff.unseal, state.tenants.salt_key.secret, tenant.name)


def _expanded(
    state: ProxyState,
    ctx: RequestContext,
    tenant: Tenant,
    protocol: GenerationProtocol,
    body: dict[str, Any],
    expand: Expand,
) -> dict[str, Any]:
    items = state.metrics.client_compaction_items
    try:
        body, count = expand(body, unsealer(state, tenant))
    except wire.InvalidCompactionItem:
        items.labels(protocol.route, "refused").inc()
        raise
    if count:
        items.labels(protocol.route, "expanded").inc(count)
        ctx.actions.append(f"compaction_expanded:{count}")
    return body


def _no_chain(body: dict[str, Any]) -> None:
    """A compaction of a ``previous_response_id`` chain would need the history the backend holds,
    which the request does not carry: refused, saying what works instead."""
    if body.get("previous_response_id") is not None:
        raise InvalidRequest(
            "compaction through this proxy needs the conversation in 'input': it cannot compact a "
            "previous_response_id chain (the backend holds that history). Send the whole input instead.",
            param="previous_response_id",
        )


async def _summarize(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    tenant: Tenant,
    protocol: GenerationProtocol,
    body: dict[str, Any],
    instruction: str | None,
    *,
    before_turn: bool = False,
) -> tuple[str, Usage | None]:
    """The summary of the request's conversation, asked of its backend as a turn of it is sent
    (the protocol's view, canonicalized, the tenant's cache salt, the conversation's routing key),
    accounted on ``ctx`` (usage, actions, metrics) and charged to the tenant's usage budget.

    ``before_turn``: the request goes on to a turn, whose usage is the answer's; the summary's is
    counted here, and its upstream time kept apart."""
    view = protocol.view(body, state.canonicalizer.tool_orders, tenant.name)
    chat = view.chat
    ctx.model = str(chat["model"])
    ctx.stream = bool(body.get("stream"))
    canon = canonicalize(state, ctx, tenant, view)
    named = state.sessions.explicit_id(request.headers, chat)
    ctx.session_id = named
    # Routed as a turn of the conversation (the session record aside): to the backend holding its prefix.
    ctx.route_key = routing_key(tenant.name, named, canon.prefix_hash, canon.body["messages"])
    metrics = state.metrics
    headers = upstream_headers(state, request, ctx)
    ctx.mark_upstream_sent()
    try:
        text, usage = await state.compaction.summarize_conversation(
            tenant,
            canon.body,
            protocol.channel(view),
            headers,
            ctx.route_key,
            instruction=instruction,
            session_id=named,
        )
    except ProxyError:
        metrics.client_compactions.labels(protocol.route, "failed").inc()
        raise
    finally:
        ctx.upstream_done_at = time.perf_counter()
        if before_turn:
            ctx.upstream_over()
    ctx.actions.append("compaction_served")
    metrics.client_compactions.labels(protocol.route, "served").inc()
    if before_turn:
        if usage is not None:
            metrics.record_usage(ctx.model or "", ctx.tenant, usage)
    else:
        ctx.usage = usage
        saved = tokens_saved(state, protocol, canon, usage, ctx.saved_by_canonicalization, instruction)
        if saved:
            metrics.client_compaction_tokens_saved.labels(protocol.route).inc(saved)
    return text, usage


def tokens_saved(
    state: ProxyState,
    protocol: GenerationProtocol,
    canon: CanonResult,
    usage: Usage | None,
    by_canonicalization: bool,
    instruction: str | None,
) -> int:
    """Prefill tokens the client compacting locally would have computed and the proxy's summary
    request did not; an estimate, a lower bound (docs/metrics.md).

    Codex (the client that sends ``compaction_trigger``) compacts locally with the history and its
    prompt but without the tools, which most templates render first: its request recomputes at
    least the turns after the system prompt, and the prompt. So for a Responses conversation with
    tools: those turns and the instruction, counted by the proxy's token counter, less what the
    summary request computed. Anywhere else the local request would share the conversation's
    prefix as the proxy's does (Claude Code's, per its docs): only what hit because the proxy
    canonicalized the prefix counts, as for any request (a local compaction sent straight to the
    backend would have missed it)."""
    if usage is None:
        return 0
    if protocol is RESPONSES and canon.body.get("tools"):
        prompt = instruction or state.settings.summarizer.instruction or DEFAULT_INSTRUCTION
        turns = [*canon.body["messages"][canon.stable_count :], {"role": "user", "content": prompt}]
        return max(0, state.token_counter.count_messages(turns) - usage.prefill_tokens)
    return usage.cached_tokens if by_canonicalization else 0


def _compaction_message(
    state: ProxyState, ctx: RequestContext, body: dict[str, Any], summary: str, token: str, usage: Usage | None
) -> Response:
    """The Message holding the compaction block alone (``stop_reason`` ``compaction``), streamed or not."""
    answer = wire.anthropic_answer(_id("msg_"), str(body["model"]), summary, token, usage)
    if body.get("stream"):
        return _answer(state, ctx, wire.anthropic_events(answer), "text/event-stream")
    return _answer(state, ctx, dumps(answer), "application/json")


def _answer(state: ProxyState, ctx: RequestContext, content: bytes, media_type: str) -> Response:
    """The proxy's own answer, with its headers; metrics and the access line after it is sent."""
    overhead = ctx.overhead_seconds()
    headers: Mapping[str, str] = {**proxy_headers(ctx), **overhead_header(overhead)}
    if media_type == "text/event-stream":
        headers = {**headers, "cache-control": "no-cache"}
    return Response(
        content, 200, headers=dict(headers), media_type=media_type, background=after_response(state, ctx, overhead)
    )


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


routes = [Route("/v1/responses/compact", api_endpoint("responses_compact", compact), methods=["POST"])]
