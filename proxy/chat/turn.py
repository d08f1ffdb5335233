"""One chat request's session side: identity, summary anchoring, budgets, accounting."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cachetools import LRUCache

from proxy.backends import (
    LLAMA_SERVER,
    OPENAI_LIMIT_FIELDS,
    BackendPool,
    ModelCatalog,
    limit_fields,
    refuses_answer_room,
)
from proxy.canon import Canonicalizer, CanonResult
from proxy.chat.admission import budget_refused
from proxy.chat.budget import (
    EXACT_COUNT_SLACK,
    ContextCheck,
    RequestSizes,
    budget_for,
    check_context,
    context_limit,
    estimate_prompt_tokens,
    fast_estimate,
    near_limit,
    prompt_ceiling,
    request_bytes,
    reservation_amount,
    spent_when_cut_short,
    tokens_per_event,
    usage_limits,
)
from proxy.chat.compaction import CompactionJob, CompactionService
from proxy.config import BudgetSettings, Settings
from proxy.http import ContextLengthExceeded
from proxy.observability import Metrics
from proxy.openai import Usage
from proxy.protocols import CHAT, SummaryChannel
from proxy.sessions import Reservation, SessionService, SessionView, StoreUnavailable, UsageLimit, conversation_root
from proxy.tenants import Tenant
from proxy.tokenization import CAUTIOUS_TOKENS_PER_BYTE, TYPICAL_TOKENS_PER_BYTE, TokenCounter
from summarizer import Anchored, Known, SummaryState, anchor, is_due, needed_soon, requests_until_used

# A session's summary as read from its record, by the record's dict (an in-process store hands out
# the same dict until the summary changes): its covered fingerprints (one a message it stands for)
# are made into a set once, not on every request. Each entry holds its dict, so no id is reused.
_SUMMARIES: LRUCache[int, tuple[dict[str, Any], SummaryState]] = LRUCache(1024)


def summary_of(data: dict[str, Any] | None) -> SummaryState:
    """``SummaryState.from_json(data)``, made once per summary read (not to be changed)."""
    if data is None:
        return SummaryState()
    found = _SUMMARIES.get(id(data))
    if found is not None and found[0] is data:
        return found[1]
    state = SummaryState.from_json(data)
    _SUMMARIES[id(data)] = (data, state)
    return state


@dataclass(frozen=True)
class TurnServices:
    """The long-lived services a turn uses, by name; built once, in ``proxy.app``. The settings are
    not among them: a turn reads the snapshot it began with (a reload swaps it between requests)."""

    sessions: SessionService
    models: ModelCatalog
    compaction: CompactionService
    metrics: Metrics
    canonicalizer: Canonicalizer
    backends: BackendPool
    token_counter: TokenCounter
    request_sizes: RequestSizes


def routing_key(
    tenant: str,
    named_session: str | None,
    prefix_hash: str | None,
    messages: list[dict[str, Any]],
    root: int | None = None,
) -> str:
    """Which backend's cache a request belongs in (:attr:`ChatTurn.routing_key`): the session the
    client names, else the stable prefix and the conversation's first message (``root`` when the
    session record knows it)."""
    if named_session:
        return f"{tenant}\x1fs:{named_session}"
    if root is None:
        root = conversation_root(messages)
    return f"{tenant}\x1fp:{prefix_hash}:{root or 0:x}"


@dataclass
class ChatTurn:
    """Created before the upstream call; :meth:`finish` accounts the result."""

    services: TurnServices
    settings: Settings
    tenant: Tenant
    budget: BudgetSettings
    canonical: dict[str, Any]
    stable_count: int
    session: SessionView | None
    summary: SummaryState = field(default_factory=SummaryState)
    anchored: Anchored | None = None
    limit: int | None = None
    # The model's context at the engine (max_model_len), where known: what a request without
    # max_tokens may generate up to.
    engine_context: int | None = None
    # The fields the engine reads for a completion's limit (``proxy.backends.limit_fields``).
    limit_fields: tuple[str, ...] = OPENAI_LIMIT_FIELDS
    request_bytes: int = 0
    reservation: Reservation | None = None
    # The usage limits of a request admitted without a reservation (the store was down).
    unreserved: list[UsageLimit] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    prefix_hash: str | None = None
    system_tail: str = ""
    prompt_estimate: int = 0
    # The session id the client gave (hashed), known even when the store is down.
    named_session: str | None = None
    # A summary is ready, but the conversation still fits well without it (summarizer.apply_ratio).
    summary_deferred: bool = False
    # How a summary of this conversation is requested: in the protocol the client speaks.
    channel: SummaryChannel = CHAT
    # False when the history is not in the request (a Responses chain held by the backend): no
    # summary can stand in for it.
    summarize: bool = True
    # Tokens of that history, which the request does not show but the backend renders.
    history_tokens: int = 0
    # Indices into ``canonical["messages"]`` of the messages canonicalization made (CanonResult.inserted).
    inserted: tuple[int, ...] = ()

    @property
    def routing_key(self) -> str:
        """Which backend's cache this request belongs in (docs/routing.md).

        A client-named session is its own key. Otherwise the key is the stable prefix and the
        conversation's first message. Neither needs the session store (both hold while it is down,
        and on every replica), and an inferred session that forks keeps its key (conversations that
        opened alike share a backend, and the prefix cached there).
        """
        root = self.session.fingerprints[0] if self.session is not None and self.session.fingerprints else None
        return routing_key(self.tenant.name, self.named_session, self.prefix_hash, self.canonical["messages"], root)

    @property
    def forwarded(self) -> dict[str, Any]:
        if self.anchored is None:
            return self.canonical
        return {**self.canonical, "messages": self.anchored.messages}

    @property
    def session_id(self) -> str | None:
        return self.session.session_id if self.session else None

    @property
    def lane_key(self) -> str | None:
        """The conversation this request continues, for the miss explanation: the session, or for a
        side lane of a named session, the session and the lane's root (docs/analysis.md)."""
        if self.session is None:
            return None
        if self.session.lane is None:
            return self.session.session_id
        return f"{self.session.session_id}\x1f{self.session.lane:x}"

    def forwarded_inserted(self) -> frozenset[int]:
        """Indices into ``forwarded["messages"]`` of the messages canonicalization made (moved by the
        summary and the restored messages before them; gone where the summary replaced them)."""
        if self.anchored is None:
            return frozenset(self.inserted)
        positions = (self.anchored.position(index) for index in self.inserted)
        return frozenset(position for position in positions if position is not None)

    def client_index(self, forwarded_index: int) -> int | None:
        """Which message of the client's (chat-shaped) request the forwarded message
        ``forwarded_index`` is, or comes just before (a block canonicalization made); None for the
        proxy's summary and the messages it restored."""
        index = forwarded_index
        anchored = self.anchored
        if anchored is not None and (anchored.removed or anchored.restored) and index >= anchored.insert_at:
            if index < anchored.history_start + anchored.restored:
                return None
            index = index - anchored.history_start - anchored.restored + anchored.insert_at + anchored.removed
        return index - sum(1 for made in self.inserted if made < index)

    @classmethod
    async def begin(
        cls,
        services: TurnServices,
        settings: Settings,
        tenant: Tenant,
        headers: Mapping[str, str],
        body: dict[str, Any],
        canon: CanonResult,
        *,
        channel: SummaryChannel = CHAT,
        summarize: bool = True,
        history_tokens: int = 0,
        session_id: str | None = None,
    ) -> ChatTurn:
        canonical = canon.body
        model = str(canonical.get("model"))
        budget = budget_for(settings, model, tenant.budget)
        named = session_id or services.sessions.explicit_id(headers, body)
        try:
            # Lanes only in a session the client names: one the proxy knows (a Responses chain) is
            # continued by the request whatever it holds.
            session = await services.sessions.resolve(
                tenant.name, canonical["messages"], named, lanes=session_id is None
            )
        except StoreUnavailable:
            session = None
        turn = cls(
            services,
            settings,
            tenant,
            budget,
            canonical,
            canon.stable_count,
            session,
            prefix_hash=canon.prefix_hash,
            system_tail=canon.system_tail,
            named_session=named,
            channel=channel,
            summarize=summarize,
            history_tokens=history_tokens,
            inserted=canon.inserted,
        )
        if session is not None and session.record is not None:
            turn.summary = summary_of(session.record.summary)
        turn._anchor()
        turn.engine_context = await services.models.max_model_len(model)
        engine = services.models.engine(model)
        turn.limit_fields = limit_fields(engine)
        answer_room = refuses_answer_room(engine)
        turn.limit = context_limit(budget, turn.engine_context, canonical, answer_room=answer_room)
        if turn._defers_summary():
            turn.summary_deferred = True
            turn._anchor()
        check = await turn._check()
        if check.over_hard and (job := turn._compaction_job(list(turn.forwarded["messages"]))) is not None:
            summary = await services.compaction.compact_now(job)
            if summary is not None:
                turn.summary = summary
                turn._anchor()
                check = await turn._check()
        # Refused here only over a limit the operator set. The one derived from the model is the
        # engine's to enforce: the estimate can be off either way, vLLM clamps max_tokens to what
        # the context leaves, and the proxy must never refuse what the backend would accept (nor
        # refuse because its own store could not supply the summary).
        if check.over_hard and check.limit is not None and budget.context_limit_tokens is not None:
            services.metrics.budget_rejections.labels("context", services.metrics.tenant_label(tenant.name)).inc()
            raise ContextLengthExceeded(check.estimate, check.limit)
        await turn._reserve(check.estimate)
        return turn

    def _anchor(self) -> None:
        """Apply the session's summary (and window repair) to the canonical request. Not to a side
        lane, nor to a request that opens another conversation (``SessionView.opens_elsewhere``):
        the summary and its tail are of the session's conversation, which neither extends."""
        settings = self.settings.summarizer
        session = self.session
        if not settings.enabled or session is None or not self.summarize or session.side_lane:
            return
        if session.opens_elsewhere:
            return
        model = self.canonical.get("model")
        self.anchored = anchor(
            self.canonical["messages"],
            SummaryState() if self.summary_deferred else self.summary,
            self.stable_count,
            repair=self.repairs_window,
            repair_needs_reply=not session.explicit,
            # A model whose template takes one system message only (found out by a refusal, or
            # configured with relocate_target system_end) gets the summary inside it.
            into_system=self.services.canonicalizer.one_system_message(model),
            system_tail=self.system_tail,
            known=self._known(),
        )
        self.actions = self.anchored.actions

    def _known(self) -> Known | None:
        """The session's fingerprints and the budget's sizes of the canonical messages, for the
        summary to find what it stands for in passes of C (a summary in place stands for most of a
        long conversation's history)."""
        fingerprinted = self.session.fingerprinted if self.session is not None else None
        if fingerprinted is None or not self.summary.covered:
            return None
        messages = self.canonical["messages"]
        if len(fingerprinted.counts) != len(messages) + 1:
            return None  # resolved on another list
        ends = self.services.request_sizes.ends_of(self.tenant.name, messages)
        return Known(fingerprinted.previous, fingerprinted.counts, ends)

    def _defers_summary(self) -> bool:
        """Whether to forward the client's whole history although a summary could replace part of it.

        Swapping the summary in makes the backend recompute every turn after it once, which a
        direct connection never pays; it is worth that only once the conversation nears its
        context budget. Until then the history goes as sent and keeps hitting the cache. Sessions
        that repair a sliding window need the summary for what their client no longer sends.
        """
        ratio = self.settings.summarizer.apply_ratio
        if self.anchored is None or not self.anchored.removed or self.limit is None or self.slides_window:
            return False
        tokens_per_byte = self.session.tokens_per_byte if self.session else None
        whole = fast_estimate(
            request_bytes(self.canonical, self.services.request_sizes, self.tenant.name), tokens_per_byte
        )
        return whole <= self.limit * ratio

    @property
    def repairs_window(self) -> bool:
        """Restore what a sliding window dropped (``summarizer.sliding_window_repair``). A session the
        client names is certain. An inferred one (mode "inferred", the default) where the window
        re-sends replies the backend generated for the conversation (``anchor``), and never where
        the request starts with a conversation opening the proxy saw open in another session
        (``SessionView.opens_elsewhere``): with deterministic replies a conversation whose whole
        history equals the end of another's shares every pair with it but its first, and where it
        began is what tells it from a slide of that one. Either way the tail must have been
        forwarded after this request's system prompt and tools."""
        mode = self.settings.summarizer.sliding_window_repair
        if mode == "off" or self.session is None or (mode == "named" and not self.session.explicit):
            return False
        if self.session.side_lane or self.session.opens_elsewhere:
            return False  # a side task's window is not the conversation's, nor another conversation's
        if not self.session.explicit and (self.session.record is None or not self.session.record.opening):
            # An inferred session whose opening the store does not hold (kept by a build before
            # openings were recorded): where it began cannot be told, so neither can a slide.
            return False
        return not self.summary.tail_prefix or self.summary.tail_prefix == self.prefix_hash

    @property
    def slides_window(self) -> bool:
        """A session whose client slides a window (seen now, or earlier: it has a repair tail)."""
        return self.repairs_window and self.session is not None and (bool(self.summary.tail) or self.session.slid)

    async def summary_slot(self) -> int | None:
        """On llama-server, the idle slot the first turn carrying a new summary goes to: the one
        holding its conversation (:meth:`ConversationSlots.for_turn`); None otherwise."""
        session, anchored = self.session, self.anchored
        if session is None or anchored is None or not anchored.removed or not self.summary.active:
            return None
        model = str(self.forwarded.get("model"))
        if self.services.models.engine(model) != LLAMA_SERVER:
            return None
        slots = self.services.compaction.slots
        if not slots.carried_first(self.tenant.name, session.session_id, self.summary):
            return None
        messages = self.forwarded["messages"]
        return await slots.for_turn(
            self.tenant.name, session.session_id, messages, model, self.routing_key, self.upstream_auth_headers()
        )

    def upstream_auth_headers(self) -> dict[str, str]:
        """How the proxy's own requests for this tenant (summaries, token counts) authenticate upstream."""
        return self.services.backends.credentials(self.tenant.upstream_api_key)

    async def _check(self) -> ContextCheck:
        forwarded = self.forwarded
        self.request_bytes = request_bytes(forwarded, self.services.request_sizes, self.tenant.name)
        tokens_per_byte = self.session.tokens_per_byte if self.session else None
        if self.budget.exact_counts_via_tokenize and near_limit(
            fast_estimate(self.request_bytes, tokens_per_byte), self.limit
        ):
            exact = await self.services.models.count_prompt_tokens(forwarded, self.upstream_auth_headers())
            if exact is not None:
                return check_context(exact + self.history_tokens, self.limit)
        estimate = estimate_prompt_tokens(
            self.services.token_counter, forwarded, self.request_bytes, tokens_per_byte, self.limit
        )
        return check_context(estimate + self.history_tokens, self.limit)

    async def _reserve(self, prompt_estimate: int) -> None:
        """Admit the request against its usage budgets, reserving the most it can spend.

        The prompt part is :func:`prompt_ceiling`, a bound whatever the tokenizer (history the
        backend holds counted as it reported it). Only when that does not fit is the backend asked
        for the exact count (``POST /tokenize``), so admission near the end of a budget is exact
        and everywhere else costs no round trip. The store down: admitted unreserved (pass-through,
        never an outage)."""
        limits = usage_limits(self.budget, self.tenant.name, self.session_id)
        if not limits:
            return
        self.prompt_estimate = prompt_estimate
        forwarded = self.forwarded
        ceiling = prompt_ceiling(self.request_bytes, len(forwarded["messages"])) + self.history_tokens
        amount = reservation_amount(
            max(ceiling, prompt_estimate), forwarded, self.budget, self.engine_context, self.limit_fields
        )
        try:
            reservation = await self.services.sessions.reserve(limits, amount, self.budget.window_s)
            if not reservation.admitted:
                exact = await self.services.models.count_prompt_tokens(forwarded, self.upstream_auth_headers())
                if exact is not None:
                    exact_amount = reservation_amount(
                        exact + EXACT_COUNT_SLACK + self.history_tokens,
                        forwarded,
                        self.budget,
                        self.engine_context,
                        self.limit_fields,
                    )
                    if exact_amount < amount:
                        reservation = await self.services.sessions.reserve(limits, exact_amount, self.budget.window_s)
        except StoreUnavailable:
            self.unreserved = limits  # charged once the answer's usage is known
            return
        if not reservation.admitted:
            raise budget_refused(self.services.metrics, self.tenant.name, reservation)
        self.reservation = reservation

    async def finish(self, usage: Usage | None, reply: dict[str, Any] | None) -> None:
        """Account the answered request: session counters, budget settlement, summary upkeep."""
        if self.unreserved and usage is not None:
            spent = usage.total_tokens
            await self.services.sessions.charge_unreserved(self.unreserved, spent, self.budget.window_s)
        if self.session is None:
            return
        await self.services.sessions.record(
            self.session,
            usage,
            reply,
            self.forwarded["messages"],
            self.request_bytes,
            self.reservation,
            self.budget.window_s,
        )
        if self.settings.summarizer.enabled and usage is not None:
            slots, model = self.services.compaction.slots, str(self.forwarded.get("model"))
            slots.answered(self.tenant.name, self.session.session_id, model, usage.total_tokens)
        if self.settings.summarizer.enabled and reply is not None and self.anchored is not None:
            messages = [*self.forwarded["messages"], reply]
            due = self._compaction_due(usage, messages)
            # Most answered turns neither start a compaction nor keep a repair tail: the job (and
            # what it carries, the routing key among them) is built only for those that do.
            if due or self.slides_window:
                job = self._compaction_job(messages, usage)
                if job is not None:
                    await self.services.compaction.after_answer(job, due=due)
        self._count_summary_savings()

    async def compact_for_engine(self) -> bool:
        """The engine refused the forwarded prompt as longer than its context (an estimate, or a
        context the proxy did not know, let it through): apply the summary deferred until the
        context's end, or compact now. Whether the forwarded request changed (then it is sent once
        more, before anything reached the client)."""
        before = self.forwarded["messages"]
        if self.summary_deferred:
            self.summary_deferred = False
            self._anchor()
        if self.forwarded["messages"] == before:
            job = self._compaction_job(list(before))
            summary = await self.services.compaction.compact_now(job) if job is not None else None
            if summary is not None:
                self.summary = summary
                self._anchor()
        return self.forwarded["messages"] != before

    def _compaction_job(self, messages: list[dict[str, Any]], usage: Usage | None = None) -> CompactionJob | None:
        """What a compaction of this conversation needs, as it stands now; None without a session
        or a summary anchor. ``usage``: the answer ``messages`` end with, as the engine counted it
        (what its context has left after them)."""
        if self.session is None or self.anchored is None:
            return None
        context = self.engine_context or self.limit
        room = context - usage.total_tokens if context and usage else None
        return CompactionJob(
            tenant=self.tenant,
            session_id=self.session.session_id,
            summary=self.summary,
            forwarded=self.forwarded,
            messages=messages,
            history_start=self.anchored.history_start,
            channel=self.channel,
            upstream_auth=self.upstream_auth_headers(),
            routing_key=self.routing_key,
            prefix_hash=self.prefix_hash,
            slides_window=self.slides_window,
            tokens_per_byte=self.session.tokens_per_byte,
            inserted=self.forwarded_inserted(),
            room=room,
            requests_until_used=self._requests_until_used(usage),
            left_tokens=usage.total_tokens if usage else None,
        )

    def _compaction_due(self, usage: Usage | None, messages: list[dict[str, Any]]) -> bool:
        """Whether the answered conversation should be folded now: past the soft threshold, or (for
        a repaired window) restoring more than ``repair_max_tokens``; never while a summary waits."""
        if self.summary_deferred:
            return False  # a summary is ready and waits until the conversation needs it
        context = usage.total_tokens if usage else 0
        if is_due(context, self.limit, self.budget.soft_ratio) and self._summary_needed_soon(usage):
            return True
        if self.repairs_window and self.anchored is not None and self.anchored.restored:
            restored = messages[self.anchored.history_start :]
            restored_bytes = sum(len(str(m.get("content") or "")) for m in restored)
            tokens_per_byte = CAUTIOUS_TOKENS_PER_BYTE
            if usage and self.request_bytes:
                tokens_per_byte = usage.prompt_tokens / self.request_bytes
            return restored_bytes * tokens_per_byte > self.settings.summarizer.repair_max_tokens
        return False

    def _summary_needed_soon(self, usage: Usage | None) -> bool:
        """Past the soft threshold, whether the summary computed now would be used within
        ``summarizer.lookahead_requests`` requests at the conversation's latest growth: a summary
        that waits (``apply_ratio``) costs a request no direct connection makes. A window that
        slides needs its summary for what the client no longer sends."""
        if usage is None or self.limit is None or self.slides_window or self.session is None:
            return True
        previous = self.session.record.context_tokens if self.session.record else 0
        used_at = self.limit * self.settings.summarizer.apply_ratio
        lookahead = self.settings.summarizer.lookahead_requests
        return needed_soon(usage.prompt_tokens, usage.completion_tokens, previous, used_at, lookahead)

    def _requests_until_used(self, usage: Usage | None) -> int | None:
        """In how many requests a summary computed now replaces history (``apply_ratio``), at the
        conversation's latest growth; None where it is used at once (a sliding window) or unknown."""
        if usage is None or self.limit is None or self.slides_window or self.session is None:
            return None
        previous = self.session.record.context_tokens if self.session.record else 0
        used_at = self.limit * self.settings.summarizer.apply_ratio
        return requests_until_used(usage.prompt_tokens, usage.completion_tokens, previous, used_at)

    def finish_later(self, usage: Usage | None, reply: dict[str, Any] | None) -> None:
        """:meth:`finish` from synchronous code (the end of a stream), as a background task."""
        if self.session is not None or self.unreserved:
            self.services.sessions.spawn(self.finish(usage, reply))

    def _count_summary_savings(self) -> None:
        if self.anchored is None or not self.anchored.removed_bytes:
            return
        # Tokens of the history the summary stands in for, less the summary itself.
        tokens_per_byte = (self.session.tokens_per_byte if self.session else None) or TYPICAL_TOKENS_PER_BYTE
        saved = int(self.anchored.removed_bytes * tokens_per_byte) - self.summary.tokens
        if saved > 0:
            self.services.metrics.record_saved(str(self.canonical.get("model")), self.tenant.name, "summary", saved)

    async def abandon(self) -> None:
        """The upstream failed: give the reserved tokens back."""
        await self._settle_early(0)

    @property
    def tokens_per_event(self) -> int:
        """Tokens one streamed event of this request may carry (``stream_interval``; else one)."""
        return tokens_per_event(self.canonical)

    async def settle_unfinished(self, usage: Usage | None, tokens_relayed: int) -> None:
        """A stream ended early (the client left, the upstream broke off): charge what was spent and
        give the rest of the reservation back (:func:`proxy.chat.budget.spent_when_cut_short`: the
        events relayed count :attr:`tokens_per_event` each)."""
        reserved = self.reservation.amount if self.reservation is not None else None
        await self._settle_early(spent_when_cut_short(usage, self.prompt_estimate, tokens_relayed, reserved))

    async def _settle_early(self, spent: int) -> None:
        await self.services.sessions.settle(self.reservation, spent, self.budget.window_s)
