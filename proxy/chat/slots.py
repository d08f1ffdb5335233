"""Which llama-server slot holds each session's conversation, for the requests that must keep to it.

llama-server keeps one prompt per slot (``--parallel N``). A request goes to the free slot whose
prompt shares the most with its own (above ``--slot-prompt-similarity``, 0.10), else to the least
recently used free slot, whose conversation is then lost; a request that names ``id_slot`` gets
that slot, deferred while it is busy (server-context.cpp ``get_available_slot``). Two requests of
the proxy share too little with their conversation's slot to be given it, and would evict another
session's conversation:

- a summary request, when it reaches the engine while the conversation's next turn computes in
  the slot (the slot is busy, so the request takes another one);
- the first turn that carries a new summary (it shares only the system prompt with the slot: the
  summary replaced the history).

So each names the slot that holds its conversation. ``GET /slots`` lists each slot's size
(``n_prompt_tokens``: its last request's prompt and completion, less one, once done) and, only on
a server started with ``LLAMA_SERVER_SLOTS_DEBUG=1``, its prompt text. A slot is found by text
where the prompts are listed, else by the size the session's last request left there: the size
its last answered turn left, looked for as that turn is recorded (the slot is idle and holds it
then; once the next turn computes in it, its size says nothing of the conversation), or the size
its summary request left.

Other engines: nothing is asked, nothing is named. Per session, three small numbers are kept
(bounded, least recently used out); no text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cachetools import LRUCache

from proxy.backends import LLAMA_SERVER, ModelCatalog
from summarizer import SummaryState

# Sessions whose slot sizes and last carried summary are remembered.
REMEMBERED_SESSIONS = 10_000

SessionKey = tuple[str, str]  # (tenant, session id)


class ConversationSlots:
    """Per session, what finds the llama-server slot holding its conversation (module docstring)."""

    def __init__(self, models: ModelCatalog | None) -> None:
        self._models = models
        # The summary (version, made at) the session's turns last carried: the first turn that
        # carries a new one is the one that must name its slot (``carried_first``).
        self._carried: LRUCache[SessionKey, tuple[int, float]] = LRUCache(REMEMBERED_SESSIONS)
        # The tokens the session's last summary request, and its last answered turn, left in the
        # engine (prompt and completion).
        self._summary_tokens: LRUCache[SessionKey, int] = LRUCache(REMEMBERED_SESSIONS)
        self._turn_tokens: LRUCache[SessionKey, int] = LRUCache(REMEMBERED_SESSIONS)

    def answered(self, tenant: str, session_id: str, model: str, left_tokens: int) -> None:
        """A turn of the session was answered and left ``left_tokens`` (prompt and completion) in
        the engine."""
        if self._models is not None and self._models.engine(model) == LLAMA_SERVER:
            self._turn_tokens[(tenant, session_id)] = left_tokens

    def summarized(self, tenant: str, session_id: str, left_tokens: int) -> None:
        """The session's summary request was answered and left ``left_tokens`` in the engine."""
        self._summary_tokens[(tenant, session_id)] = left_tokens

    def carried_first(self, tenant: str, session_id: str, summary: SummaryState) -> bool:
        """Whether a turn of ``session_id`` carrying ``summary`` is the first to carry it (here)."""
        key, made = (tenant, session_id), (summary.version, summary.updated)
        if self._carried.get(key) == made:
            return False
        self._carried[key] = made
        return True

    async def holding_answered(
        self, model: str, left_tokens: int | None, routing_key: str, upstream_auth: Mapping[str, str]
    ) -> int | None:
        """The idle slot that holds the turn just answered (``left_tokens`` less one), or None. Asked
        as the turn is recorded, before the client's next turn can reach the slot."""
        if self._models is None or not left_tokens:
            return None
        return await self._models.slot_holding(
            [], model=model, key=routing_key, headers=upstream_auth, idle_only=True, sizes=(left_tokens - 1,)
        )

    async def for_summary(
        self, body: dict[str, Any], routing_key: str, upstream_auth: Mapping[str, str], answered_in: int | None
    ) -> int | None:
        """The slot a summary request names: the one whose listed prompt holds the conversation it
        carries (its messages but the instruction), else ``answered_in`` (the slot found holding
        the turn that made the summary due), else None. The request waits for it if it is busy."""
        messages = body.get("messages")
        if self._models is None or not isinstance(messages, list):
            return answered_in
        found = await self._models.slot_holding(
            messages[:-1], model=str(body.get("model")), key=routing_key, headers=upstream_auth
        )
        return answered_in if found is None else found

    async def for_turn(
        self,
        tenant: str,
        session_id: str,
        messages: list[Any],
        model: str,
        routing_key: str,
        upstream_auth: Mapping[str, str],
    ) -> int | None:
        """The idle slot a turn carrying a new summary names, or None: the slot the session's last
        summary request, or its last answered turn, left as it was (as many tokens as its prompt
        and completion, less one: a turn that came while the summary was made computed in the
        conversation's slot after it), or whose listed prompt holds the turn's messages but its new
        question. An idle slot named does not make the turn wait."""
        if self._models is None:
            return None
        key = (tenant, session_id)
        left = (self._summary_tokens.get(key), self._turn_tokens.get(key))
        return await self._models.slot_holding(
            messages[:-1],
            model=model,
            key=routing_key,
            headers=upstream_auth,
            idle_only=True,
            sizes=tuple(tokens - 1 for tokens in left if tokens),
        )
