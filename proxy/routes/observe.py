"""What a chat route calls: explain the forwarded prompt, then account the answer.

Kept apart from the route so the route gains two calls, not the logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.http.context import RequestContext
from proxy.observability.capture import arrival, capture_record
from proxy.observability.tracker import summary_index
from proxy.openai.usage import Usage

if TYPE_CHECKING:
    from proxy.app_state import ProxyState
    from proxy.chat.turn import ChatTurn


@dataclass(frozen=True)
class Observed:
    """A request on its way: its capture ticket (arrival order and time)."""

    seq: int = 0
    arrived: float = 0.0


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
    if state.capture is None:
        return Observed()
    return Observed(state.capture.next_seq(), arrival())


def after_answer(
    state: ProxyState,
    ctx: RequestContext,
    observed: Observed,
    body: dict[str, Any],
    reply: dict[str, Any] | None,
    usage: Usage | None,
) -> None:
    """The backend answered: remember its reply (it caches those tokens too) and capture."""
    if ctx.cache_break is not None:
        ctx.cache_break.record_reply(reply)
    if state.capture is not None and observed.seq:
        state.capture.write(
            capture_record(
                observed.seq, observed.arrived, ctx.tenant, ctx.session_id, body, usage, reply, backend=ctx.backend
            )
        )


def needs_reply_content(state: ProxyState) -> bool:
    """Streams must keep the reply's text: for the reply hash and for the capture."""
    return state.cache_breaks.enabled or state.capture is not None
