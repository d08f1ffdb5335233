"""One chat request's session side: identity, summary anchoring, budgets, accounting."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.budget import (
    ContextCheck,
    check_context,
    context_limit,
    effective_budget,
    estimate_prompt_tokens,
    fast_estimate,
    near_limit,
    request_bytes,
    reservation_amount,
    usage_limits,
)
from proxy.canon import CanonResult
from proxy.config import BudgetSettings
from proxy.errors import ProxyError
from proxy.sessions.identity import conversation_root
from proxy.sessions.model import Reservation
from proxy.sessions.service import SessionView, StoreUnavailable
from proxy.state import ProxyState
from proxy.tenants import Tenant
from proxy.usage import Usage
from summarizer import Anchored, SummaryState, anchor


def context_length_exceeded(estimate: int, limit: int) -> ProxyError:
    return ProxyError(
        400,
        f"This conversation needs about {estimate} tokens, over its context budget of {limit} tokens "
        "(the model's context length minus max_tokens). Shorten the history or lower max_tokens.",
        param="messages",
        code="context_length_exceeded",
    )


def budget_exhausted(kind: str, retry_after_s: int) -> ProxyError:
    return ProxyError(
        429,
        f"The {kind} token budget for this window is spent; retry after {retry_after_s} s.",
        type="rate_limit_error",
        code=f"{kind}_budget_exceeded",
        headers={"retry-after": str(retry_after_s)},
    )


@dataclass
class ChatTurn:
    """Created before the upstream call; :meth:`finish` accounts the result."""

    state: ProxyState
    tenant: Tenant
    budget: BudgetSettings
    canonical: dict[str, Any]
    stable_count: int
    session: SessionView | None
    summary: SummaryState = field(default_factory=SummaryState)
    anchored: Anchored | None = None
    limit: int | None = None
    request_bytes: int = 0
    reservation: Reservation | None = None
    actions: list[str] = field(default_factory=list)
    prefix_hash: str | None = None
    system_tail: str = ""
    prompt_estimate: int = 0
    # The session id the client gave (hashed), known even when the store is down.
    named_session: str | None = None

    @property
    def routing_key(self) -> str:
        """Which backend's cache this request belongs in (docs/routing.md).

        A client-named session is its own key. Otherwise the key is the stable prefix and the
        conversation's first message. Neither needs the session store (both hold while it is down,
        and on every replica), and an inferred session that forks keeps its key (conversations that
        opened alike share a backend, and the prefix cached there).
        """
        if self.named_session:
            return f"{self.tenant.name}\x1fs:{self.named_session}"
        if self.session is not None and self.session.fingerprints:
            root: int | None = self.session.fingerprints[0]
        else:
            root = conversation_root(self.canonical["messages"])
        return f"{self.tenant.name}\x1fp:{self.prefix_hash}:{root or 0:x}"

    @property
    def forwarded(self) -> dict[str, Any]:
        if self.anchored is None:
            return self.canonical
        return {**self.canonical, "messages": self.anchored.messages}

    @property
    def session_id(self) -> str | None:
        return self.session.session_id if self.session else None

    @classmethod
    async def begin(
        cls, state: ProxyState, tenant: Tenant, headers: Mapping[str, str], body: dict[str, Any], canon: CanonResult
    ) -> ChatTurn:
        canonical = canon.body
        model = str(canonical.get("model"))
        budget = effective_budget(state.settings.budget, state.settings.model_budgets.get(model), tenant.budget)
        try:
            session = await state.sessions.resolve(tenant.name, headers, body, canonical["messages"])
        except StoreUnavailable:
            session = None
        turn = cls(
            state,
            tenant,
            budget,
            canonical,
            canon.stable_count,
            session,
            prefix_hash=canon.prefix_hash,
            system_tail=canon.system_tail,
            named_session=state.sessions.explicit_id(headers, body),
        )
        if session is not None and session.record is not None:
            turn.summary = SummaryState.from_json(session.record.summary)
        turn._anchor()
        turn.limit = context_limit(budget, await state.models.max_model_len(model), canonical)
        check = await turn._check()
        if check.over_hard and turn.anchored is not None and await state.compaction.compact_now(turn):
            turn._anchor()
            check = await turn._check()
        if check.over_hard and check.limit is not None:
            state.metrics.budget_rejections.labels("context", state.metrics.tenant_label(tenant.name)).inc()
            raise context_length_exceeded(check.estimate, check.limit)
        await turn._reserve(check.estimate)
        return turn

    def _anchor(self) -> None:
        """Apply the session's summary (and window repair) to the canonical request."""
        settings = self.state.settings.summarizer
        if not settings.enabled or self.session is None:
            return
        model = self.canonical.get("model")
        self.anchored = anchor(
            self.canonical["messages"],
            self.summary,
            self.stable_count,
            repair=self.repairs_window,
            # A model whose template takes one system message only (found out by a refusal, or
            # configured with relocate_target system_end) gets the summary inside it.
            into_system=self.state.canonicalizer.one_system_message(model),
            system_tail=self.system_tail,
        )
        self.actions = self.anchored.actions

    @property
    def repairs_window(self) -> bool:
        """Repair only sessions the client names: an inferred identity cannot tell a sliding window
        from another conversation that happens to repeat this one's messages, and restoring would
        then put someone else's messages into the request."""
        return (
            self.state.settings.summarizer.sliding_window_repair and self.session is not None and self.session.explicit
        )

    def upstream_auth_headers(self) -> dict[str, str]:
        """How the proxy's own requests for this tenant (summaries, token counts) authenticate upstream."""
        key = self.tenant.upstream_api_key
        return {"authorization": f"Bearer {key}"} if key else self.state.upstream.auth_headers(None)

    async def _check(self) -> ContextCheck:
        forwarded = self.forwarded
        self.request_bytes = request_bytes(forwarded)
        tokens_per_byte = self.session.tokens_per_byte if self.session else None
        if self.budget.exact_counts_via_tokenize and near_limit(
            fast_estimate(self.request_bytes, tokens_per_byte), self.limit
        ):
            headers = (
                {"authorization": f"Bearer {self.tenant.upstream_api_key}"} if self.tenant.upstream_api_key else {}
            )
            exact = await self.state.models.count_prompt_tokens(
                forwarded, headers or self.state.upstream.auth_headers(None)
            )
            if exact is not None:
                return check_context(exact, self.limit, self.budget.soft_ratio)
        estimate = estimate_prompt_tokens(
            self.state.token_counter, forwarded, self.request_bytes, tokens_per_byte, self.limit
        )
        return check_context(estimate, self.limit, self.budget.soft_ratio)

    async def _reserve(self, prompt_estimate: int) -> None:
        limits = usage_limits(self.budget, self.tenant.name, self.session_id)
        if not limits:
            return
        amount = reservation_amount(prompt_estimate, self.forwarded, self.budget)
        self.prompt_estimate = prompt_estimate
        try:
            reservation = await self.state.sessions.reserve(limits, amount, self.budget.window_s)
        except StoreUnavailable:
            return
        if not reservation.admitted:
            kind = reservation.rejected_kind or "usage"
            self.state.metrics.budget_rejections.labels(kind, self.state.metrics.tenant_label(self.tenant.name)).inc()
            raise budget_exhausted(kind, reservation.retry_after_s)
        self.reservation = reservation

    async def finish(self, usage: Usage | None, reply: dict[str, Any] | None) -> None:
        """Account the answered request: session counters, budget settlement, summary upkeep."""
        if self.session is None:
            return
        await self.state.sessions.record(
            self.session,
            usage,
            reply,
            self.forwarded["messages"],
            self.request_bytes,
            self.reservation,
            self.budget.window_s,
        )
        if self.state.settings.summarizer.enabled:
            await self.state.compaction.after_turn(self, usage, reply)
        self._count_summary_savings()

    def finish_later(self, usage: Usage | None, reply: dict[str, Any] | None) -> None:
        """:meth:`finish` from synchronous code (the end of a stream), as a background task."""
        if self.session is not None:
            self.state.sessions.spawn(self.finish(usage, reply))

    def _count_summary_savings(self) -> None:
        if self.anchored is None or not self.anchored.removed_bytes:
            return
        # Tokens of the history the summary stands in for, less the summary itself.
        tokens_per_byte = (self.session.tokens_per_byte if self.session else None) or 0.25
        saved = int(self.anchored.removed_bytes * tokens_per_byte) - self.summary.tokens
        if saved > 0:
            self.state.metrics.record_saved(str(self.canonical.get("model")), self.tenant.name, "summary", saved)

    async def abandon(self) -> None:
        """The upstream failed: give the reserved tokens back."""
        await self._settle_early(0)

    async def settle_unfinished(self, usage: Usage | None, events_relayed: int) -> None:
        """A stream ended early (the client left, the upstream broke off): charge what was spent and
        give the rest of the reservation back. Without the usage chunk, the prompt and one token per
        event relayed (vLLM streams about one per event), never more than was reserved."""
        if usage is not None:
            spent = usage.prompt_tokens + usage.completion_tokens
        else:
            spent = self.prompt_estimate + events_relayed
            if self.reservation is not None:
                spent = min(spent, self.reservation.amount)
        await self._settle_early(spent)

    async def _settle_early(self, spent: int) -> None:
        if self.reservation is not None and self.reservation.keys:
            store = self.state.sessions.store
            with contextlib.suppress(StoreUnavailable):
                await self.state.sessions.call(
                    store.settle(self.reservation, spent - self.reservation.amount, self.budget.window_s)
                )
