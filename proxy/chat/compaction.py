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
import contextlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from cachetools import TLRUCache

from proxy.backends import BackendPool, ModelCatalog
from proxy.chat.admission import Admitted, UsageAdmission
from proxy.chat.budget import prompt_ceiling, request_bytes
from proxy.chat.decoding import DecodeRates
from proxy.chat.slots import ConversationSlots
from proxy.config import SummarizerSettings
from proxy.http import ProxyError, UpstreamProtocolError, UpstreamTimeout
from proxy.observability import Metrics
from proxy.openai import Usage, dumps
from proxy.protocols import SummaryChannel
from proxy.sessions import SessionService, StoreUnavailable
from proxy.tenants import Tenant, TenantDirectory
from proxy.tokenization import TYPICAL_TOKENS_PER_BYTE
from summarizer import (
    DEFAULT_INSTRUCTION,
    Compaction,
    CompactionFailed,
    Compactor,
    CompactorOptions,
    SummaryPolicy,
    SummaryState,
    build_request,
    client_messages,
    kept_when_used,
)

logger = logging.getLogger("prefix_proxy.summarizer")
WAIT_POLL_S = 0.2


class SummaryRefused(UpstreamProtocolError):
    """502: the backend answered the summary request with an error status (nothing was summarized)."""

    code = "summary_failed"

    def __init__(self, status: int, configured_model: str | None = None) -> None:
        message = f"the backend answered HTTP {status} to the summary request; nothing was compacted"
        if configured_model and status in (400, 404):
            message += (
                f" (its model is summarizer.model, {configured_model!r}: set it to a model the backend serves, "
                "or remove it to summarize with the conversation's own model)"
            )
        self._describe(message, None, None)


@dataclass(frozen=True)
class CompactionJob:
    """What a compaction needs from the turn that asks for it, taken when it asks: the service never
    sees the turn, and a background compaction works on this snapshot while the turn moves on."""

    tenant: Tenant
    session_id: str
    # The summary the turn saw: a compaction applies only if the stored one is still this version.
    summary: SummaryState
    forwarded: Mapping[str, Any]
    # The conversation to fold: as forwarded, plus the reply once there is one.
    messages: list[dict[str, Any]]
    history_start: int
    # How the summary is asked for (the conversation's protocol) and how it authenticates upstream.
    channel: SummaryChannel
    upstream_auth: Mapping[str, str]
    routing_key: str
    prefix_hash: str | None
    # The client slides a window: the uncovered tail is kept for its repair.
    slides_window: bool
    tokens_per_byte: float | None
    # Indices of ``messages`` the proxy inserted (blocks of moved volatile lines): the client never
    # sent them as messages, so no repair tail keeps them (a repair restores what the client sent).
    inserted: frozenset[int] = frozenset()
    # Tokens the engine's context leaves after ``messages`` (None: not known): where a summary fits
    # in it, the summary request carries the whole conversation (a slot engine keeps its prompt).
    room: int | None = None
    # In how many requests the conversation is foreseen to carry the summary (None: not foreseen,
    # or at once): the turns that come meanwhile count among the ones it leaves verbatim.
    requests_until_used: int | None = None
    # The tokens the answered turn left in the engine (its prompt and completion; None: no usage),
    # and the llama-server slot found holding them as the turn was recorded (``after_answer``).
    left_tokens: int | None = None
    slot: int | None = None


class CompactionService:
    def __init__(
        self,
        settings: SummarizerSettings,
        sessions: SessionService,
        backends: BackendPool,
        tenants: TenantDirectory,
        metrics: Metrics,
        admission: UsageAdmission | None = None,
        models: ModelCatalog | None = None,
    ) -> None:
        self.settings = settings
        # Where the engine keeps one conversation per slot (llama-server), which slot holds it.
        self.slots = ConversationSlots(models)
        # Every summary is generation: admitted against the tenant's usage budget first.
        self._admission = admission
        self._sessions = sessions
        self._backends = backends
        self._tenants = tenants
        self._metrics = metrics
        # Sessions whose compaction failed -> until when they are left alone (monotonic time).
        self._backoff: TLRUCache[tuple[str, str], float] = TLRUCache(
            10_000, ttu=lambda _session, until, _now: until, timer=time.monotonic
        )
        self._options = CompactorOptions(
            max_summary_tokens=settings.max_summary_tokens,
            timeout_s=settings.timeout_s,
            instruction=settings.instruction or DEFAULT_INSTRUCTION,
            model=settings.model,
        )
        self._policy = SummaryPolicy(keep_last_turns=settings.keep_last_turns)
        # The engine's decoding pace per model, from its answers (the routes report them) and from
        # the summaries themselves: what a summary is given to finish in.
        self.decode_rates = DecodeRates()

    def deadline(self, model: str | None) -> float:
        """Seconds a summary of this model is waited for: ``timeout_s``, or longer for an engine
        seen to decode ``max_summary_tokens`` slower than that (past it the history is forwarded
        as the client sent it)."""
        return self.decode_rates.deadline(
            self._options.model or model, self._options.max_summary_tokens, self.settings.timeout_s
        )

    def _compactor(self, job: CompactionJob) -> Compactor:
        async def complete(body: dict[str, Any]) -> tuple[str, int]:
            return await self._complete(job, body)

        # The uncovered tail is kept only for sessions whose client slides a window.
        options = replace(
            self._options, repair=job.slides_window, timeout_s=self.deadline(str(job.forwarded.get("model")))
        )
        keep = kept_when_used(self._policy.keep_last_turns, job.requests_until_used)
        return Compactor(complete, replace(self._policy, keep_last_turns=keep), options)

    async def _complete(self, job: CompactionJob, body: dict[str, Any]) -> tuple[str, int]:
        started = time.perf_counter()
        try:
            text, usage = await self._request_summary(
                job.tenant, job.channel, body, job.upstream_auth, job.routing_key, job.session_id, job.slot
            )
        except ProxyError as exc:
            raise CompactionFailed(exc.message) from exc
        if usage is not None:
            self.slots.summarized(job.tenant.name, job.session_id, usage.total_tokens)
            self._metrics.record_usage(str(body.get("model")), job.tenant.name, usage)
            self.decode_rates.observe(str(body.get("model")), usage.completion_tokens, time.perf_counter() - started)
        return text, usage.completion_tokens if usage else 0

    async def _request_summary(
        self,
        tenant: Tenant,
        channel: SummaryChannel,
        body: dict[str, Any],
        upstream_auth: Mapping[str, str],
        routing_key: str,
        session_id: str | None,
        slot: int | None = None,
    ) -> tuple[str, Usage | None]:
        """The one upstream call of every summary (the background compaction's and a client's):
        admitted against the tenant's (and ``session_id``'s) usage budget, ``body`` (chat-shaped)
        sent in the conversation's own protocol, with its cache salt, to its backend, and the budget
        settled to its usage. ``slot``: the llama-server slot found holding the conversation when it
        was last answered, named where no slot is found holding it now. Raises a :class:`ProxyError`
        when no readable answer came, and :class:`BudgetExceeded` when the budget has no room for it
        (nothing is sent)."""
        admitted = await self._admit(tenant, body, session_id)
        usage: Usage | None = None
        try:
            text, usage = await self._send_summary(tenant, channel, body, upstream_auth, routing_key, slot)
        finally:
            if admitted is not None:
                await admitted.settle(usage)
        return text, usage

    async def _admit(self, tenant: Tenant, body: Mapping[str, Any], session_id: str | None) -> Admitted | None:
        if self._admission is None:
            return None
        messages = body.get("messages") or []
        most = prompt_ceiling(request_bytes(dict(body)), len(messages)) + int(
            body.get("max_tokens") or self._options.max_summary_tokens
        )
        return await self._admission.admit(tenant, str(body.get("model")), session_id, most)

    async def _send_summary(
        self,
        tenant: Tenant,
        channel: SummaryChannel,
        body: dict[str, Any],
        upstream_auth: Mapping[str, str],
        routing_key: str,
        answered_in: int | None = None,
    ) -> tuple[str, Usage | None]:
        payload = self._tenants.cache_salted(tenant, channel.request(body))  # its cache namespace
        slot = await self.slots.for_summary(body, routing_key, upstream_auth, answered_in)
        if slot is not None:
            # A slot engine: the summary waits for the slot that holds the conversation, if it is
            # busy, instead of taking another one and evicting the conversation held there.
            payload = {**payload, "id_slot": slot}
        headers = {"content-type": "application/json", **upstream_auth}
        # Same backend as the conversation: the summary request starts with its cached prefix.
        response = await self._backends.open(
            "POST",
            channel.path,
            content=dumps(payload),
            headers=headers,
            key=routing_key,
            model=str(body.get("model")),
        )
        raw = await self._backends.read(response)
        if response.status_code >= 400:
            raise SummaryRefused(response.status_code, self.settings.model)
        try:
            text, usage = channel.reply(json.loads(raw))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise UpstreamProtocolError("unreadable summary response") from exc
        return str(text), usage

    async def summarize_conversation(
        self,
        tenant: Tenant,
        chat: Mapping[str, Any],
        channel: SummaryChannel,
        upstream_auth: Mapping[str, str],
        routing_key: str,
        *,
        instruction: str | None = None,
        session_id: str | None = None,
    ) -> tuple[str, Usage | None]:
        """A summary of the whole conversation ``chat``, for a client that asked to compact it
        (docs/compaction.md): ``chat`` is the request's canonical chat view, as a turn of it is
        forwarded, so the summary request (that conversation plus the instruction, in ``channel``'s
        protocol, with the tenant's cache salt, routed by ``routing_key``) renders as the
        conversation did and its prefix hits the cache. ``instruction``: the client's own, else the
        configured one, else the default.

        Returns the summary (stripped) and the backend's usage, which is not recorded here (the
        client's request accounts it). Raises a :class:`ProxyError` when no summary came: the
        upstream's (unreachable, timed out), :class:`SummaryRefused`, or an
        :class:`UpstreamProtocolError` for an unreadable or empty answer."""
        body = build_request(
            dict(chat),
            list(chat["messages"]),
            instruction=instruction or self._options.instruction,
            max_tokens=self._options.max_summary_tokens,
            model=self._options.model,
        )
        deadline = self.deadline(str(body.get("model")))
        try:
            text, usage = await asyncio.wait_for(
                self._request_summary(tenant, channel, body, upstream_auth, routing_key, session_id), deadline
            )
        except TimeoutError:
            raise UpstreamTimeout(
                f"the summary request took longer than {deadline:g} s (summarizer.timeout_s, or the time the "
                "engine's measured decoding rate needs for max_summary_tokens)"
            ) from None
        text = text.strip()
        if not text:
            raise UpstreamProtocolError("the backend returned an empty summary")
        return text, usage

    # -- entry points ----------------------------------------------------------------------------

    async def after_answer(self, job: CompactionJob, *, due: bool) -> None:
        """Once a request has been answered: keep the repair tail, start a compaction if ``due``.

        The tail is saved before the answer is released, so the client's next request (which
        may follow at once) finds it; the compaction itself runs in the background.
        """
        # The tail is kept for clients seen to slide a window: every other session stores none.
        if job.slides_window:
            await self._save_tail(job, client_messages(job.messages, job.history_start, job.inserted))
        if due and not self._backing_off(job):
            self._sessions.spawn(self._run_locked(await self._with_slot(job), wait=False))

    async def _with_slot(self, job: CompactionJob) -> CompactionJob:
        """``job`` with the llama-server slot that holds its conversation, found now, as the turn that
        made it due is recorded (``ConversationSlots.holding_answered``); other engines: as it is."""
        model = str(job.forwarded.get("model"))
        slot = await self.slots.holding_answered(model, job.left_tokens, job.routing_key, job.upstream_auth)
        return job if slot is None else replace(job, slot=slot)

    async def compact_now(self, job: CompactionJob) -> SummaryState | None:
        """Synchronous compaction for a request over the hard limit: the session's new summary (also
        one another request or replica just wrote), or None when it is unchanged."""
        return await self._run_locked(job, wait=True)

    # -- work -----------------------------------------------------------------------------------

    async def _run_locked(self, job: CompactionJob, *, wait: bool) -> SummaryState | None:
        sessions = self._sessions
        store = sessions.store
        tenant, session_id = job.tenant.name, job.session_id
        lock = f"compact:{tenant}:{session_id}"
        try:
            try:
                token = await sessions.call(store.acquire_lock(lock, self.settings.lock_ttl_s))
            except StoreUnavailable:
                return await self._run_unshared(job)
            if token is None:
                return await self._wait_for_other(job) if wait else None
            try:
                current = await self._stored_summary(job)
                if current.version != job.summary.version:
                    return current  # another request or replica compacted meanwhile
                compaction = await self._compact(job, current)
                if compaction is None:
                    return None
                if compaction.state.tail:
                    compaction.state.tail_prefix = job.prefix_hash or ""
                await sessions.set_summary(tenant, session_id, compaction.state.to_json())
                return compaction.state
            finally:
                await sessions.call(store.release_lock(lock, token))
        except StoreUnavailable:
            return None

    async def _run_unshared(self, job: CompactionJob) -> SummaryState | None:
        """The shared store is down: compact on the spot, from the summary the request carried,
        into this replica's copy of the session (no lock to take: at worst two replicas fold the
        same turns once each). Without such a copy, nothing (the history goes as it is)."""
        if self._sessions.local is None:
            return None
        compaction = await self._compact(job, job.summary)
        if compaction is None:
            return None
        if compaction.state.tail:
            compaction.state.tail_prefix = job.prefix_hash or ""
        with contextlib.suppress(StoreUnavailable):
            await self._sessions.set_summary(job.tenant.name, job.session_id, compaction.state.to_json())
        return compaction.state

    async def _stored_summary(self, job: CompactionJob) -> SummaryState:
        record = await self._sessions.get(job.tenant.name, job.session_id)
        return SummaryState.from_json(record.summary if record else None)

    async def _compact(self, job: CompactionJob, current: SummaryState) -> Compaction | None:
        compactor = self._compactor(job)
        if not compactor.plan(job.messages, job.history_start):
            return None
        metrics = self._metrics
        metrics.compactions.labels("started").inc()
        started = time.perf_counter()
        try:
            compaction = await compactor.compact(
                current, dict(job.forwarded), job.messages, job.history_start, job.inserted, room=job.room
            )
        except CompactionFailed as exc:
            metrics.compactions.labels("failed").inc()
            self._backoff[(job.tenant.name, job.session_id)] = time.monotonic() + self.settings.retry_backoff_s
            logger.warning("compaction failed, history forwarded unchanged: %s", exc)
            return None
        if compaction is None:
            return None
        metrics.compactions.labels("succeeded").inc()
        metrics.compaction_seconds.observe(time.perf_counter() - started)
        removed = int(compaction.folded_bytes * (job.tokens_per_byte or TYPICAL_TOKENS_PER_BYTE))
        metrics.compaction_tokens_removed.inc(removed)
        metrics.summary_tokens.inc(compaction.state.tokens)
        return compaction

    async def _wait_for_other(self, job: CompactionJob) -> SummaryState | None:
        deadline = time.monotonic() + self.deadline(str(job.forwarded.get("model")))
        while time.monotonic() < deadline:
            await asyncio.sleep(WAIT_POLL_S)
            current = await self._stored_summary(job)
            if current.version != job.summary.version:
                return current
        return None

    async def _save_tail(self, job: CompactionJob, tail: list[dict[str, Any]]) -> None:
        try:
            current = await self._stored_summary(job)
            if current.version != job.summary.version:
                return  # a compaction wrote a fresher tail
            current.tail = tail[-200:]
            current.tail_prefix = job.prefix_hash or ""
            await self._sessions.set_summary(job.tenant.name, job.session_id, current.to_json())
        except StoreUnavailable:
            return

    def _backing_off(self, job: CompactionJob) -> bool:
        return (job.tenant.name, job.session_id) in self._backoff
