"""One chat request's session side: identity, context budget, usage budget, accounting."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.budget import (
    check_context,
    context_limit,
    effective_budget,
    estimate_prompt_tokens,
    request_bytes,
    reservation_amount,
    usage_limits,
)
from proxy.config import BudgetSettings
from proxy.errors import ProxyError
from proxy.sessions.model import Reservation
from proxy.sessions.service import SessionView, StoreUnavailable
from proxy.state import ProxyState
from proxy.tenants import Tenant
from proxy.usage import Usage


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
    forwarded: dict[str, Any]
    session: SessionView | None
    request_bytes: int
    reservation: Reservation | None = None
    over_soft_limit: bool = False

    @classmethod
    async def begin(
        cls,
        state: ProxyState,
        tenant: Tenant,
        headers: Mapping[str, str],
        body: dict[str, Any],
        forwarded: dict[str, Any],
    ) -> ChatTurn:
        model = str(forwarded.get("model"))
        budget = effective_budget(state.settings.budget, state.settings.model_budgets.get(model), tenant.budget)
        try:
            session = await state.sessions.resolve(tenant.name, headers, body, forwarded["messages"])
        except StoreUnavailable:
            session = None
        size = request_bytes(forwarded)
        limit = context_limit(budget, await state.models.max_model_len(model), forwarded)
        tokens_per_byte = session.tokens_per_byte if session else None
        estimate = estimate_prompt_tokens(state.token_counter, forwarded, size, tokens_per_byte, limit)
        turn = cls(state, tenant, budget, forwarded, session, size)
        check = check_context(estimate, limit, budget.soft_ratio)
        turn.over_soft_limit = check.over_soft
        if check.over_hard and check.limit is not None:
            state.metrics.budget_rejections.labels("context", state.metrics.tenant_label(tenant.name)).inc()
            raise context_length_exceeded(check.estimate, check.limit)
        await turn._reserve(check.estimate)
        return turn

    async def _reserve(self, prompt_estimate: int) -> None:
        limits = usage_limits(self.budget, self.tenant.name, self.session.session_id if self.session else None)
        if not limits:
            return
        amount = reservation_amount(prompt_estimate, self.forwarded, self.budget)
        try:
            reservation = await self.state.sessions.reserve(limits, amount, self.budget.window_s)
        except StoreUnavailable:
            return
        if not reservation.admitted:
            kind = reservation.rejected_kind or "usage"
            self.state.metrics.budget_rejections.labels(kind, self.state.metrics.tenant_label(self.tenant.name)).inc()
            raise budget_exhausted(kind, reservation.retry_after_s)
        self.reservation = reservation

    @property
    def session_id(self) -> str | None:
        return self.session.session_id if self.session else None

    async def finish(self, usage: Usage | None, reply: Mapping[str, Any] | None) -> None:
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

    def finish_later(self, usage: Usage | None, reply: Mapping[str, Any] | None) -> None:
        if self.session is None:
            return
        self.state.sessions.record_later(
            self.session,
            usage,
            reply,
            self.forwarded["messages"],
            self.request_bytes,
            self.reservation,
            self.budget.window_s,
        )

    async def abandon(self) -> None:
        """The upstream failed: give the reserved tokens back."""
        if self.reservation is not None and self.reservation.keys:
            with contextlib.suppress(StoreUnavailable):
                await self.state.sessions.call(
                    self.state.sessions.store.settle(self.reservation, -self.reservation.amount, self.budget.window_s)
                )
