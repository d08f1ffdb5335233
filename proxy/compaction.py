"""The summarizer at the proxy's edge: locks, the store, the upstream call, metrics.

A compaction runs in the background once a session passes its soft threshold,
so no request waits for it; only a request over the hard limit waits for a
synchronous one. One compaction at a time per session across all replicas (a
store lock with expiry, and a version check after taking it). A failed or
timed-out compaction changes nothing: the original history is forwarded, the
failure is counted, and the session is retried after a back-off.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from proxy.errors import ProxyError
from proxy.jsonio import dumps
from proxy.sessions.service import StoreUnavailable
from proxy.usage import Usage
from summarizer import (
    Compaction,
    CompactionFailed,
    Compactor,
    CompactorOptions,
    SummaryPolicy,
    SummaryState,
    is_due,
)
from summarizer.prompt import DEFAULT_INSTRUCTION

if TYPE_CHECKING:
    from proxy.state import ProxyState
    from proxy.turns import ChatTurn

logger = logging.getLogger("prefix_proxy.summarizer")
WAIT_POLL_S = 0.2


class CompactionService:
    def __init__(self, state: ProxyState) -> None:
        self._state = state
        settings = state.settings.summarizer
        self.settings = settings
        self._background: set[asyncio.Task[Any]] = set()
        self._backoff: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._options = CompactorOptions(
            max_summary_tokens=settings.max_summary_tokens,
            timeout_s=settings.timeout_s,
            instruction=settings.instruction or DEFAULT_INSTRUCTION,
            model=settings.model,
            repair=settings.sliding_window_repair,  # the tail is kept only for sessions that repair
        )
        self._policy = SummaryPolicy(keep_last_turns=settings.keep_last_turns)

    def _compactor(self, turn: ChatTurn) -> Compactor:
        async def complete(body: dict[str, Any]) -> tuple[str, int]:
            return await self._complete(turn, body)

        return Compactor(complete, self._policy, self._options)

    async def _complete(self, turn: ChatTurn, body: dict[str, Any]) -> tuple[str, int]:
        upstream = self._state.upstream
        body = self._state.tenants.cache_salted(turn.tenant, body)  # the conversation's cache namespace
        headers = {"content-type": "application/json", **turn.upstream_auth_headers()}
        try:
            # Same backend as the conversation: the summary request starts with its cached prefix.
            response = await upstream.open(
                "POST",
                "/chat/completions",
                content=dumps(body),
                headers=headers,
                key=turn.routing_key,
                model=str(body.get("model")),
            )
            raw = await upstream.read(response)
        except ProxyError as exc:
            raise CompactionFailed(exc.message) from exc
        if response.status_code >= 400:
            raise CompactionFailed(f"upstream answered {response.status_code}")
        try:
            reply = json.loads(raw)
            text = reply["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise CompactionFailed("unreadable summary response") from exc
        usage = Usage.from_openai(reply.get("usage"))
        if usage is not None:
            self._state.metrics.record_usage(str(body.get("model")), turn.tenant.name, usage)
        return str(text), usage.completion_tokens if usage else 0

    # -- triggers -------------------------------------------------------------------------------

    async def after_turn(self, turn: ChatTurn, usage: Usage | None, reply: dict[str, Any] | None) -> None:
        """Called once a request has been answered: keep the repair tail, start a compaction if due.

        The tail is saved before the answer is released, so the client's next request (which
        may follow at once) finds it; the compaction itself runs in the background.
        """
        if turn.session is None or turn.anchored is None or reply is None:
            return
        messages = [*turn.forwarded["messages"], reply]
        if turn.repairs_window:
            await self._save_tail(turn, messages[turn.anchored.history_start :])
        if self._due(turn, usage, messages) and not self._backing_off(turn):
            self._spawn(self._run_locked(turn, messages, wait=False))

    def _due(self, turn: ChatTurn, usage: Usage | None, messages: list[dict[str, Any]]) -> bool:
        context = usage.prompt_tokens + usage.completion_tokens if usage else 0
        if is_due(context, turn.limit, turn.budget.soft_ratio):
            return True
        if turn.repairs_window and turn.anchored is not None and turn.anchored.restored:
            restored_bytes = sum(len(str(m.get("content") or "")) for m in messages[turn.anchored.history_start :])
            tokens_per_byte = (usage.prompt_tokens / turn.request_bytes) if usage and turn.request_bytes else 0.5
            return restored_bytes * tokens_per_byte > self.settings.repair_max_tokens
        return False

    async def compact_now(self, turn: ChatTurn) -> bool:
        """Synchronous compaction for a request over the hard limit; True when the summary changed."""
        if turn.session is None or turn.anchored is None:
            return False
        return await self._run_locked(turn, list(turn.forwarded["messages"]), wait=True)

    # -- work -----------------------------------------------------------------------------------

    async def _run_locked(self, turn: ChatTurn, messages: list[dict[str, Any]], *, wait: bool) -> bool:
        assert turn.session is not None and turn.anchored is not None
        sessions = self._state.sessions
        store = sessions.store
        tenant, session_id = turn.tenant.name, turn.session.session_id
        lock = f"compact:{tenant}:{session_id}"
        try:
            token = await sessions.call(store.acquire_lock(lock, self.settings.lock_ttl_s))
            if token is None:
                return await self._wait_for_other(turn) if wait else False
            try:
                record = await sessions.call(store.get(tenant, session_id))
                current = SummaryState.from_json(record.summary if record else None)
                if current.version != turn.summary.version:
                    return True  # another request or replica compacted meanwhile
                compaction = await self._compact(turn, current, messages)
                if compaction is None:
                    return False
                await sessions.call(store.set_summary(tenant, session_id, compaction.state.to_json()))
                turn.summary = compaction.state
                return True
            finally:
                await sessions.call(store.release_lock(lock, token))
        except StoreUnavailable:
            return False

    async def _compact(
        self, turn: ChatTurn, current: SummaryState, messages: list[dict[str, Any]]
    ) -> Compaction | None:
        assert turn.anchored is not None and turn.session is not None
        compactor = self._compactor(turn)
        if not compactor.plan(messages, turn.anchored.history_start):
            return None
        metrics = self._state.metrics
        metrics.compactions.labels("started").inc()
        started = time.perf_counter()
        try:
            compaction = await compactor.compact(current, turn.forwarded, messages, turn.anchored.history_start)
        except CompactionFailed as exc:
            metrics.compactions.labels("failed").inc()
            self._backoff[(turn.tenant.name, turn.session.session_id)] = (
                time.monotonic() + self.settings.retry_backoff_s
            )
            while len(self._backoff) > 10_000:
                self._backoff.popitem(last=False)
            logger.warning("compaction failed, history forwarded unchanged: %s", exc)
            return None
        if compaction is None:
            return None
        metrics.compactions.labels("succeeded").inc()
        metrics.compaction_seconds.observe(time.perf_counter() - started)
        tokens_per_byte = turn.session.tokens_per_byte or 0.25
        removed = int(compaction.folded_bytes * tokens_per_byte)
        metrics.compaction_tokens_removed.inc(removed)
        metrics.summary_tokens.inc(compaction.state.tokens)
        return compaction

    async def _wait_for_other(self, turn: ChatTurn) -> bool:
        assert turn.session is not None
        deadline = time.monotonic() + self.settings.timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(WAIT_POLL_S)
            record = await self._state.sessions.call(
                self._state.sessions.store.get(turn.tenant.name, turn.session.session_id)
            )
            current = SummaryState.from_json(record.summary if record else None)
            if current.version != turn.summary.version:
                turn.summary = current
                return True
        return False

    async def _save_tail(self, turn: ChatTurn, tail: list[dict[str, Any]]) -> None:
        assert turn.session is not None
        sessions = self._state.sessions
        try:
            record = await sessions.call(sessions.store.get(turn.tenant.name, turn.session.session_id))
            current = SummaryState.from_json(record.summary if record else None)
            if current.version != turn.summary.version:
                return  # a compaction wrote a fresher tail
            current.tail = tail[-200:]
            await sessions.call(
                sessions.store.set_summary(turn.tenant.name, turn.session.session_id, current.to_json())
            )
        except StoreUnavailable:
            return

    def _backing_off(self, turn: ChatTurn) -> bool:
        assert turn.session is not None
        until = self._backoff.get((turn.tenant.name, turn.session.session_id))
        return until is not None and time.monotonic() < until

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
