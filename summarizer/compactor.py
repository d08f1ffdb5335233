"""The compactor: asks the backend model for a summary of the oldest turns.

I/O is injected (``complete`` sends one chat request and returns the reply text
and usage), so the compactor itself is easy to test. A compaction either
produces a complete new :class:`SummaryState` or raises; it never half-applies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from proxy.openai import message_fingerprint
from summarizer.anchor import is_summary_message
from summarizer.policy import SummaryPolicy, plan_chunk
from summarizer.prompt import DEFAULT_INSTRUCTION, build_request, scoped_instruction
from summarizer.state import SummaryState

Complete = Callable[[dict[str, Any]], Awaitable[tuple[str, int]]]

# Tokens the instruction message may take, from its bytes: a cautious 1 token per 3 bytes (English
# runs near 1 per 4) and the chat template's markup around one more message.
INSTRUCTION_TOKENS_PER_BYTE = 1 / 3
MESSAGE_MARKUP_TOKENS = 16


def whole_conversation_room(room: int | None, instruction: str, max_summary_tokens: int) -> int | None:
    """The summary's ``max_tokens`` when the request may carry the whole conversation, kept turns
    included, then the instruction, in the ``room`` the engine's context leaves after the
    conversation; None when it may not (room unknown, or too little left for a summary of a
    quarter of ``max_summary_tokens``: the request then stops where the folded turns end)."""
    if room is None:
        return None
    left = room - int(len(instruction.encode()) * INSTRUCTION_TOKENS_PER_BYTE) - MESSAGE_MARKUP_TOKENS
    if left < max(1, max_summary_tokens // 4):
        return None
    return min(max_summary_tokens, left)


def client_messages(messages: list[dict[str, Any]], start: int, inserted: Collection[int]) -> list[dict[str, Any]]:
    """``messages[start:]`` less the ones the proxy inserted (indices into ``messages``)."""
    return [m for index, m in enumerate(messages[start:], start) if index not in inserted]


class CompactionFailed(Exception):
    """The backend did not produce a usable summary; nothing was changed."""


@dataclass(frozen=True)
class CompactorOptions:
    max_summary_tokens: int = 512
    timeout_s: float = 60.0
    instruction: str = DEFAULT_INSTRUCTION
    model: str | None = None
    repair: bool = False


@dataclass(frozen=True)
class Compaction:
    state: SummaryState
    folded_messages: int
    folded_bytes: int


class Compactor:
    def __init__(self, complete: Complete, policy: SummaryPolicy, options: CompactorOptions) -> None:
        self._complete = complete
        self._policy = policy
        self._options = options

    def plan(self, messages: list[dict[str, Any]], history_start: int) -> bool:
        return plan_chunk(messages, history_start, self._policy) is not None

    async def compact(
        self,
        state: SummaryState,
        forwarded: dict[str, Any],
        messages: list[dict[str, Any]],
        history_start: int,
        inserted: Collection[int] = (),
        room: int | None = None,
    ) -> Compaction | None:
        """Fold the oldest turns of ``messages`` (the forwarded conversation, reply included) into ``state``.

        ``inserted``: indices of ``messages`` the proxy made (a block of moved volatile lines): never
        part of the repair tail, which restores only what the client sent.

        ``room``: tokens the engine's context leaves after ``messages`` (None: unknown). Where the
        instruction and a summary fit in it, the request carries the whole conversation and asks
        to leave the kept turns out: it extends the prompt the engine just processed, which a slot
        engine keeps whole (docs/engines.md). Otherwise it stops where the folded turns end."""
        chunk = plan_chunk(messages, history_start, self._policy)
        if chunk is None:
            return None
        kept_turns = sum(1 for m in messages[chunk.end :] if m.get("role") == "user")
        instruction = scoped_instruction(self._options.instruction, kept_turns)
        max_tokens = whole_conversation_room(room, instruction, self._options.max_summary_tokens)
        if max_tokens is None:
            instruction, max_tokens = self._options.instruction, self._options.max_summary_tokens
            sent = messages[: chunk.end]
        else:
            sent = messages
        request = build_request(
            forwarded, sent, instruction=instruction, max_tokens=max_tokens, model=self._options.model
        )
        try:
            text, tokens = await asyncio.wait_for(self._complete(request), self._options.timeout_s)
        except TimeoutError as exc:
            raise CompactionFailed("the summary request timed out") from exc
        text = text.strip()
        if not text:
            raise CompactionFailed("the backend returned an empty summary")
        folded = [m for m in messages[chunk.start : chunk.end] if not is_summary_message(m)]
        new_state = SummaryState(
            text=text,
            covered=state.covered | {message_fingerprint(m) for m in folded},
            tokens=tokens,
            version=state.version + 1,
            updated=time.time(),
            tail=client_messages(messages, chunk.end, inserted) if self._options.repair else [],
        )
        # surrogatepass: a client's lone surrogate (JSON allows one) is counted, not a 500.
        folded_bytes = sum(len(str(m.get("content") or "").encode("utf-8", "surrogatepass")) for m in folded)
        return Compaction(new_state, len(folded), folded_bytes)
