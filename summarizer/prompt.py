"""The summarization request: the conversation as it stands plus a trailing instruction.

Built from the very messages the backend has just processed (same system
prompt, same tools, same earlier summary), so its prefix hits the prefix cache
and only the instruction is new work.
"""

from __future__ import annotations

from typing import Any

DEFAULT_INSTRUCTION = (
    "Write a summary of the conversation above so far, to replace it in the assistant's memory. "
    "Keep every fact, decision, name, number, date, preference and open task; drop pleasantries and "
    "repetition. If the conversation begins with an earlier summary, merge it into the new one. "
    "Write in the language the user writes in. Output only the summary."
)


def build_request(
    forwarded: dict[str, Any],
    messages: list[dict[str, Any]],
    *,
    instruction: str,
    max_tokens: int,
    model: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model or forwarded["model"],
        "messages": [*messages, {"role": "user", "content": instruction}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": False,
    }
    for key in ("tools", "functions"):
        if forwarded.get(key):
            # Same tools as the conversation: most templates render them first, so the prefix still hits.
            body[key] = forwarded[key]
    if forwarded.get("tools"):
        body["tool_choice"] = "none"
    if forwarded.get("cache_salt"):
        # The conversation's cache namespace: without it the summary could not reuse its prefix.
        body["cache_salt"] = forwarded["cache_salt"]
    return body
