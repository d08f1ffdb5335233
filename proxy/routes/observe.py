"""What a chat route calls: explain the forwarded prompt, then account the answer; the cache
diagnostics a client asks for.

Kept apart from the route so the route gains two calls, not the logic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.http import RequestContext
from proxy.observability import PendingBreak, arrival, capture_record, summary_index
from proxy.openai import Usage
from proxy.protocols import Diagnosis, DiagnosticsAsk, ProtocolView

if TYPE_CHECKING:
    from proxy.app_state import ProxyState
    from proxy.chat import ChatTurn

logger = logging.getLogger("prefix_proxy.ui")


@dataclass(frozen=True)
class Observed:
    """A request on its way: its capture ticket (arrival order and time); for the operator's page
    (``ui.enabled``), the prompt as forwarded and its stable system messages."""

    seq: int = 0
    arrived: float = 0.0
    forwarded: dict[str, Any] | None = None
    stable_count: int = 0


def before_upstream(state: ProxyState, ctx: RequestContext, turn: ChatTurn, forwarded: dict[str, Any]) -> Observed:
    """Explain the request against what was forwarded before (sets ``ctx.cache_break``).

    ``forwarded``: the request as forwarded, in chat shape (whatever the client's protocol). Its
    predecessor is its lane's previous prompt: a side task in a named session (a title request, a
    sub-agent) is compared with its own earlier requests, never taken for the chat's next turn."""
    ctx.cache_break = state.cache_breaks.observe(
        ctx.tenant,
        turn.lane_key,
        forwarded,
        ctx.actions,
        summary_at=summary_index(turn.anchored),
        system_count=turn.stable_count,
        tokens_per_byte=turn.session.tokens_per_byte if turn.session else None,
    )
    seen = (forwarded, turn.stable_count) if state.apps is not None else (None, 0)
    if state.capture is None:
        return Observed(0, 0.0, *seen)
    return Observed(state.capture.next_seq(), arrival(), *seen)


def after_answer(
    state: ProxyState,
    ctx: RequestContext,
    observed: Observed,
    body: dict[str, Any],
    reply: dict[str, Any] | None,
    usage: Usage | None,
) -> None:
    """The backend answered: remember its reply (it caches those tokens too), how fast the engine
    decoded it (the summary deadline follows it), and capture."""
    if usage is not None and ctx.upstream_sent_at is not None:
        # From a stream's first token, else from sending: the prompt's time makes the rate cautious.
        began = ctx.first_chunk_at if ctx.stream and ctx.first_chunk_at else ctx.upstream_sent_at
        state.compaction.decode_rates.observe(
            ctx.model, usage.completion_tokens, (ctx.upstream_done_at or time.perf_counter()) - began
        )
    if ctx.cache_break is not None:
        ctx.cache_break.record_reply(reply)
    if state.apps is not None and observed.forwarded is not None and usage is not None:
        # Off the answer's path: the page's bookkeeping runs once the loop has sent what it can.
        asyncio.get_running_loop().call_soon(_record_app, state, ctx, observed, body, reply, usage)
    if state.capture is not None and observed.seq:
        state.capture.write(
            capture_record(
                observed.seq, observed.arrived, ctx.tenant, ctx.session_id, body, usage, reply, backend=ctx.backend
            )
        )


def _record_app(
    state: ProxyState,
    ctx: RequestContext,
    observed: Observed,
    body: dict[str, Any],
    reply: dict[str, Any] | None,
    usage: Usage,
) -> None:
    """What the operator's page learns of an answered request (``proxy.observability.apps``); a
    failure here is logged and costs the request nothing (it was answered)."""
    try:
        _record(state, ctx, observed, body, reply, usage)
    except Exception:
        logger.exception("the operator page's bookkeeping failed (the request was not affected)")


def _record(
    state: ProxyState,
    ctx: RequestContext,
    observed: Observed,
    body: dict[str, Any],
    reply: dict[str, Any] | None,
    usage: Usage,
) -> None:
    assert state.apps is not None and observed.forwarded is not None
    pending = ctx.cache_break
    explanation = None
    if isinstance(pending, PendingBreak):
        pending.settle(usage)  # what the response header and the counters read too (settled once)
        explanation = pending.explanation
    state.apps.record(
        tenant=ctx.tenant,
        model=str(ctx.model or body.get("model") or ""),
        client=body,
        forwarded=observed.forwarded,
        stable_count=observed.stable_count,
        actions=ctx.actions,
        session=ctx.session_id,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        explanation=explanation,
        reply=reply,
        now=time.time(),
    )


def diagnose(
    state: ProxyState, ctx: RequestContext, turn: ChatTurn, view: ProtocolView, ask: DiagnosticsAsk
) -> Diagnosis:
    """The cache diagnostics a client asked for: this request's prompt as forwarded against the
    one that the earlier answer it names answered (the tenant's own only), in the client's terms."""
    pending = ctx.cache_break
    if not isinstance(pending, PendingBreak):
        return Diagnosis("unavailable")
    if ask.previous_id is None:
        return Diagnosis("not_compared")
    found = state.cache_breaks.compare(ctx.tenant, ask.previous_id, pending)
    if found is None:
        return Diagnosis("not_found")
    if found.changed is None:
        return Diagnosis("hit", reusable_tokens=found.reusable_tokens)
    changed = found.changed
    message: int | str | None = None
    block: int | None = None
    if found.message == -1:
        message = "tools"
    elif found.message is not None:
        client = turn.client_index(found.message)
        if client is None:
            changed = "compacted"  # the difference is the proxy's summary of the conversation
        else:
            message, block = view.position(client)
    return Diagnosis(
        "miss",
        changed,
        missed_tokens=found.missed_tokens,
        reusable_tokens=found.reusable_tokens,
        message=message,
        block=block,
        line=found.line,
        token=found.divergence_token,
    )


def remember_answer(state: ProxyState, ctx: RequestContext, answer_id: str | None) -> None:
    """The backend's id of this request's answer, for a later request's diagnostics to name."""
    if answer_id and isinstance(ctx.cache_break, PendingBreak):
        state.cache_breaks.remember_answer(ctx.tenant, answer_id, ctx.cache_break)


def needs_reply_content(state: ProxyState) -> bool:
    """Streams must keep the reply's text: for the reply hash and for the capture."""
    return state.cache_breaks.enabled or state.capture is not None
