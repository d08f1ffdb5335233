"""One conversation turn through the proxy: session, budget, summary (compaction), accounting."""

from proxy.chat.admission import Admitted, UsageAdmission, budget_refused
from proxy.chat.budget import (
    RequestSizes,
    budget_for,
    completion_allowance,
    context_limit,
    effective_budget,
    prompt_ceiling,
    spent_when_cut_short,
    tokens_per_event,
    usage_limits,
)
from proxy.chat.compaction import CompactionService
from proxy.chat.turn import ChatTurn, TurnServices, routing_key

__all__ = [
    "Admitted",
    "ChatTurn",
    "CompactionService",
    "RequestSizes",
    "TurnServices",
    "UsageAdmission",
    "budget_for",
    "budget_refused",
    "completion_allowance",
    "context_limit",
    "effective_budget",
    "prompt_ceiling",
    "routing_key",
    "spent_when_cut_short",
    "tokens_per_event",
    "usage_limits",
]
