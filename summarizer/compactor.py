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
from summarizer.prompt import DEFAULT_INSTRUCTION, build_request
from summarizer.state import SummaryState

Complete = Callable[[dict[str, Any]], Awaitable[tuple[str, int]]]


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
    ) -> Compaction | None:
        """Fold the oldest turns of ``messages`` (the forwarded conversation, reply included) into ``state``.

        ``inserted``: indices of ``messages`` the proxy made (a block of moved volatile lines): never
        part of the repair tail, which restores only what the client sent."""
        chunk = plan_chunk(messages, history_start, self._policy)
        if chunk is None:
            return None
        request = build_request(
            forwarded,
            messages[: chunk.end],
            instruction=self._options.instruction,
            max_tokens=self._options.max_summary_tokens,
            model=self._options.model,
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
        folded_bytes = sum(len(str(m.get("content") or "").encode()) for m in folded)
        return Compaction(new_state, len(folded), folded_bytes)
