"""The summarization request: the conversation as it stands plus a trailing instruction.

Built from the very messages the backend has just processed (same system
prompt, same tools, same earlier summary, and the turns that stay verbatim),
so its prefix hits the prefix cache and only the instruction is new work.

The whole conversation, not only the turns to fold: a slot engine (llama.cpp's
llama-server, one KV cache per slot) keeps one prompt per slot, and a summary
request that stopped where the kept turns begin would replace the slot's copy of
them, for the conversation's next turn to compute again. Sent whole, the summary
extends the slot's prompt instead, and the instruction names what to fold.
"""

from __future__ import annotations

from typing import Any

DEFAULT_INSTRUCTION = (
    "Write a summary of the conversation above so far, to replace it in the assistant's memory. "
    "Keep every fact, decision, name, number, date, preference and open task; drop pleasantries and "
    "repetition. If the conversation begins with an earlier summary, merge it into the new one. "
    "Write in the language the user writes in. Output only the summary."
)


def scoped_instruction(instruction: str, kept_turns: int) -> str:
    """``instruction``, told to leave out the last ``kept_turns`` exchanges the request carries (they
    stay in the conversation word for word)."""
    if kept_turns <= 0:
        return instruction
    exchanges = "exchange" if kept_turns == 1 else f"{kept_turns} exchanges"
    return (
        f"{instruction} Leave out the last {exchanges} above (from the user's message on): "
        "they stay in the conversation word for word. Summarize only what comes before them."
    )


# What changes how the backend renders a prompt (the template itself, its switches, the reasoning
# effort some templates write into the system block): a summary request without them would not
# render the conversation's prefix alike, and would miss the cache from the first token.
RENDERING_FIELDS = ("chat_template", "chat_template_kwargs", "reasoning_effort", "reasoning")


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
    for key in RENDERING_FIELDS:
        if forwarded.get(key) is not None:
            body[key] = forwarded[key]
    if forwarded.get("cache_salt"):
        # The conversation's cache namespace: without it the summary could not reuse its prefix.
        body["cache_salt"] = forwarded["cache_salt"]
    return body
