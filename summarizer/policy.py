"""When to compact and what to fold. Pure functions, no I/O.

When: a session's context (as the upstream last counted it) passes the soft
threshold of its context budget (``soft_ratio``), or, with sliding-window
repair, the restored history passes ``repair_max_tokens``.

What: the oldest uncovered turns, cut at a user-turn boundary so that the last
``keep_last_turns`` turns stay verbatim. A turn runs from a user message to the
next one, so an assistant tool call and its tool results always fall on the
same side of the cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SummaryPolicy:
    keep_last_turns: int = 4
    min_turns_to_fold: int = 1


@dataclass(frozen=True)
class Chunk:
    start: int
    end: int  # exclusive; messages[end] is the first kept user message

    def __len__(self) -> int:
        return self.end - self.start


def is_due(context_tokens: int, limit: int | None, soft_ratio: float) -> bool:
    return limit is not None and context_tokens > limit * soft_ratio


def plan_chunk(messages: list[dict[str, Any]], first: int, policy: SummaryPolicy) -> Chunk | None:
    """The messages ``[start, end)`` to fold, starting at ``first`` (just after the summary or system prefix)."""
    users = [i for i in range(first, len(messages)) if messages[i].get("role") == "user"]
    if len(users) <= policy.keep_last_turns:
        return None
    end = users[len(users) - policy.keep_last_turns] if policy.keep_last_turns else len(messages)
    folded_turns = sum(1 for i in users if i < end)
    if end <= first or folded_turns < policy.min_turns_to_fold:
        return None
    return Chunk(first, end)
