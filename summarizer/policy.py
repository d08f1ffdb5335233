"""When to compact and what to fold. Pure functions, no I/O.

When: a session's context (as the upstream last counted it) passes the soft
threshold of its context budget (``soft_ratio``) and, growing as its latest
request did, would need the summary within a few requests (``needed_soon``);
or, with sliding-window repair, the restored history passes ``repair_max_tokens``.

What: the oldest uncovered turns, cut at a user-turn boundary so that the last
``keep_last_turns`` turns stay verbatim. A turn runs from a user message to the
next one, so an assistant tool call and its tool results always fall on the
same side of the cut.
"""

from __future__ import annotations

import math
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


def needed_soon(
    prompt_tokens: int, completion_tokens: int, previous_prompt_tokens: int, used_at: float, requests: int
) -> bool:
    """Whether a conversation that keeps growing as its latest request did (``prompt_tokens`` after
    ``previous_prompt_tokens``, and at least by the reply it just got) reaches ``used_at``, where a
    summary replaces its history, within ``requests`` more requests.

    A summary computed ahead costs a request (its prefill and up to ``max_summary_tokens`` of
    decoding) that a direct connection never pays, and it is used only once the conversation would
    not fit without it: an agent whose 20k-token prompt is mostly system prompt and tools, growing by
    a few hundred tokens a turn, may never get there. Without a previous request to compare with
    (the first of the session) or with ``requests`` 0, the soft threshold alone decides."""
    context = prompt_tokens + completion_tokens  # what the next request re-sends, at the least
    if requests <= 0 or previous_prompt_tokens <= 0 or context >= used_at:
        return True
    step = max(prompt_tokens - previous_prompt_tokens, completion_tokens)
    return step > 0 and prompt_tokens + requests * step >= used_at


def requests_until_used(
    prompt_tokens: int, completion_tokens: int, previous_prompt_tokens: int, used_at: float
) -> int | None:
    """In how many requests a conversation growing as its latest request did (see :func:`needed_soon`)
    first carries a summary computed now: 1 for the next request; None when its growth is unknown
    (the first request of the session, or none measured)."""
    if prompt_tokens + completion_tokens >= used_at:
        return 1
    step = max(prompt_tokens - previous_prompt_tokens, completion_tokens)
    if previous_prompt_tokens <= 0 or step <= 0:
        return None
    return max(1, math.ceil((used_at - prompt_tokens) / step))


def kept_when_used(keep_last_turns: int, requests: int | None) -> int:
    """The turns a summary computed ``requests`` requests ahead of its use leaves out, so that
    ``keep_last_turns`` whole turns follow it verbatim when it is used (each request until then adds
    one): the policy holds where the summary is read, not where it was made. A summary applied
    later than foreseen leaves more verbatim, one applied sooner fewer (at least one turn)."""
    if requests is None or keep_last_turns <= 0:
        return keep_last_turns
    return max(1, keep_last_turns - (requests - 1))


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
