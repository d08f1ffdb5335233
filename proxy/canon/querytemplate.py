"""Prompts that restate the user's question: keep each turn's restatement where it was.

Templates such as Dify's ``## 问题 \"\"\"{{#sys.query#}}\"\"\"`` or ``给你topic：{{#sys.query#}}``
inline the current user message into the system prompt. Relocation moves that line to
just before the last user turn, so turn N is forwarded as ``... [block(Q_N)] Q_N`` and
the model's answer is computed after ``block(Q_N)``. On turn N+1 the client's history has
``Q_N, A_N`` without the block, and the backend recomputes the previous question and
answer on every turn.

When the moved block is nothing but a template around the last user message, the block
turn N carried is that same template around ``Q_N``: this module re-creates it in front of
every earlier user message. It adds no information (the template text is in this request,
the question is the history's own), and it makes turn N+1 extend turn N's forwarded
prompt, answer included. Stateless: the same request gives the same result on any replica.
"""

from __future__ import annotations

from typing import Any

# A user message shorter than this could occur in the block by chance ("ok", "1").
MIN_QUERY_CHARS = 8
# The template text around the question; more than this is not a restatement.
MAX_WRAPPER_CHARS = 256


def template_of(block: str, query: str) -> tuple[str, str] | None:
    """(text before, text after) the query when ``block`` is a short template around it."""
    if len(query.strip()) < MIN_QUERY_CHARS or block.count(query) != 1:
        return None
    before, _, after = block.partition(query)
    if len(before) + len(after) > MAX_WRAPPER_CHARS:
        return None
    return before, after


def restore_query_blocks(messages: list[dict[str, Any]], block: str, first_history: int, last_user: int) -> int:
    """Insert the block's template around each earlier user message; returns how many.

    ``messages[last_user]`` is the current question, which ``block`` was moved in front of;
    only user messages in ``messages[first_history:last_user]`` get a block. Idempotent: a
    user message already preceded by its block gets none.
    """
    query = messages[last_user].get("content")
    if not isinstance(query, str):
        return 0
    template = template_of(block, query)
    if template is None:
        return 0
    before, after = template
    inserted = 0
    index = first_history
    while index < last_user + inserted:
        message = messages[index]
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, str):
            restated = {"role": "system", "content": f"{before}{content}{after}"}
            previous = messages[index - 1] if index > 0 else None
            if previous != restated:
                messages.insert(index, restated)
                inserted += 1
                index += 1
        index += 1
    return inserted
