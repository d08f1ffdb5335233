"""Admission of generation the proxy asks for itself (summaries, compaction on demand) against the
tenant's usage budget: reserved before the upstream call, settled to the backend's usage after.

Every request that makes the engine generate passes a usage budget: the chat pipeline (``ChatTurn``),
text completions (``CompletionBudget``) and, here, the summaries, whether a client asked for one
(``/v1/responses/compact``, a ``compaction_trigger``, Anthropic's ``compaction``) or the proxy compacts
a session on its own. On a spent budget none of them reaches the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.chat.budget import budget_for, usage_limits
from proxy.config import BudgetSettings, Settings
from proxy.http import BudgetExceeded
from proxy.observability import Metrics
from proxy.openai import Usage
from proxy.sessions import Reservation, SessionService, StoreUnavailable, UsageLimit
from proxy.tenants import Tenant


def budget_refused(metrics: Metrics, tenant: str, reservation: Reservation) -> BudgetExceeded:
    """The 429 of a reservation the store did not admit, counted."""
    kind = reservation.rejected_kind or "usage"
    metrics.budget_rejections.labels(kind, metrics.tenant_label(tenant)).inc()
    return BudgetExceeded(kind, reservation.retry_after_s)


@dataclass
class Admitted:
    """A request admitted against its limits: :meth:`settle` once its usage is known."""

    sessions: SessionService
    limits: list[UsageLimit]
    budget: BudgetSettings
    reservation: Reservation | None = None
    # Admitted while the store was down: charged once the usage is known.
    unreserved: bool = False
    settled: bool = field(default=False)

    async def settle(self, usage: Usage | None) -> None:
        """Charge what the backend reported (nothing answered: nothing spent). Once; never raises."""
        if self.settled:
            return
        self.settled = True
        spent = usage.total_tokens if usage is not None else 0
        if self.unreserved:
            await self.sessions.charge_unreserved(self.limits, spent, self.budget.window_s)
            return
        await self.sessions.settle(self.reservation, spent, self.budget.window_s)


class UsageAdmission:
    """Reserves a request's most before it is sent (429 when a limit has no room for it)."""

    def __init__(self, settings: Callable[[], Settings], sessions: SessionService, metrics: Metrics) -> None:
        # The settings in force, read on every admission: budgets change on a reload.
        self._settings = settings
        self._sessions = sessions
        self._metrics = metrics

    async def admit(self, tenant: Tenant, model: str, session_id: str | None, amount: int) -> Admitted:
        """Admit ``amount`` tokens for ``tenant`` (and its session); :class:`BudgetExceeded` when they
        do not fit. The store down: admitted, charged when settled (never an outage)."""
        budget = budget_for(self._settings(), model, tenant.budget)
        limits = usage_limits(budget, tenant.name, session_id)
        admitted = Admitted(self._sessions, limits, budget)
        if not limits:
            return admitted
        try:
            reservation = await self._sessions.reserve(limits, amount, budget.window_s)
        except StoreUnavailable:
            admitted.unreserved = True
            return admitted
        if not reservation.admitted:
            raise budget_refused(self._metrics, tenant.name, reservation)
        admitted.reservation = reservation
        return admitted
