"""The proxy's use of the session store, with graceful degradation.

Every store call has a deadline: each socket operation ``operation_timeout_s`` (a Redis that
stalls looks like one that died within it), the whole call four of it. Any store failure (down,
stalled, refusing) is counted, logged once per outage, and the store is left alone for
``retry_after_failure_s`` so an outage adds no latency to every request; after that the next
request probes it again, and recovery is logged. Meanwhile requests are admitted without
reservations (what they spend is counted once the store answers); sessions this replica served
recently are still known from its own bounded copy of them (``local_copy_sessions``: records,
summaries, fingerprints), so a summarized conversation keeps its summary and nothing fails for
want of the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import eq
from typing import Any, TypeVar

from cachetools import LRUCache

from proxy.config import SessionSettings
from proxy.ids import unique_id
from proxy.observability import Metrics
from proxy.openai import Continuations, Usage
from proxy.sessions.identity import (
    Fingerprinted,
    MessageFingerprint,
    Recorded,
    conversation_fingerprints,
    elect,
    explicit_session_id,
    opening_key,
    reply_fingerprint,
    weights,
)
from proxy.sessions.memory import MemorySessionStore
from proxy.sessions.model import Reservation, SessionRecord, TurnRecord, UsageLimit
from proxy.sessions.store import SessionStore

logger = logging.getLogger("prefix_proxy.sessions")
# Sets of limits (tenant, tenant and session) whose unreserved spend is held for a store outage.
MAX_PENDING_CHARGES = 10_000
T = TypeVar("T")


class StoreUnavailable(Exception):
    """The session store cannot be used right now; serve without session features. ``reason``: what
    the store answered, where it answered at all (an error, as a refused password or a database that
    does not exist); empty where it did not answer."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


def _answered(error: BaseException) -> str:
    """What a store that answered with an error said: Redis's error replies (``ERR DB index is out of
    range``, ``NOPERM``) and refused credentials (``WRONGPASS``), by redis-py's names for them; ""
    for a store that did not answer (a connection refused or lost, a timeout)."""
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & {"ResponseError", "AuthenticationError", "AuthenticationWrongNumberOfArgsError"}:
        return f"{type(error).__name__}: {error}"[:200]
    return ""


@dataclass
class SessionView:
    tenant: str
    session_id: str
    record: SessionRecord | None
    fingerprints: list[int] = field(default_factory=list)
    # The pairs the session holds already: the first ``known_prefix`` fingerprints, and these.
    known: set[int] = field(default_factory=set)
    explicit: bool = False
    known_prefix: int = 0
    # Where the request's pairs go once its turn is recorded (for its conversation's next request),
    # and the store's token for the session when it was found (``MemorySessionStore.pair_token``).
    recorded: Recorded | None = None
    token: tuple[int, int] | None = None
    # The fingerprints of the messages it was resolved on, message by message (``Fingerprinted``).
    fingerprinted: Fingerprinted | None = None
    # The request's last non-system message and its fingerprint, as resolved: the reply's pair
    # starts from it.
    last_message: MessageFingerprint | None = None
    # A side lane of a named session: the request shares the session but does not extend its
    # conversation (a title or tags request, a sub-agent, a compaction). Its root (the first pair,
    # 0 without one) names the lane; None: the session's own conversation.
    lane: int | None = None
    # The request starts with the opening of another live session than this one, whose latest turn
    # it does not continue: it re-sends a conversation from its beginning, one that only looks like
    # part of this session (deterministic replies make a conversation's whole history equal the end
    # of another's). It is never a window slid over this session, and gets none of its summary.
    opens_elsewhere: bool = False

    @property
    def side_lane(self) -> bool:
        return self.lane is not None

    @property
    def slid(self) -> bool:
        """The client's history no longer starts where its previous request's did: a sliding window."""
        if self.lane is not None:
            return False  # another lane: it never moves the conversation's window
        first = self.record.first_pair if self.record else 0
        return bool(first and self.fingerprints and self.fingerprints[0] != first)

    @property
    def tokens_per_byte(self) -> float | None:
        return self.record.tokens_per_byte if self.record and self.record.tokens_per_byte > 0 else None


class SessionService:
    def __init__(
        self,
        store: SessionStore,
        settings: SessionSettings,
        metrics: Metrics,
        *,
        forwarded: Continuations[Any] | None = None,
    ) -> None:
        self.store = store
        self._settings = settings
        self._metrics = metrics
        self._down_until = 0.0
        self._degraded = False
        # Per tenant and conversation, the last request's fingerprints: the next fingerprints only
        # what it adds (``forwarded``: the memory shared with the other parts that read these messages).
        self._forwarded: Continuations[Any] = forwarded if forwarded is not None else Continuations()
        self._background: set[asyncio.Task[Any]] = set()
        # Tokens spent by requests admitted unreserved, per set of limits, until the store is back
        # (past MAX_PENDING_CHARGES, the set charged least recently goes first).
        self._pending_charges: LRUCache[tuple[tuple[str, ...], int], tuple[list[UsageLimit], int]] = LRUCache(
            MAX_PENDING_CHARGES
        )
        # What this replica last saw of the sessions it served, for when the shared store cannot
        # answer. In-process: it never waits, never fails.
        self.local: MemorySessionStore | None = None
        if not store.in_process and settings.local_copy_sessions > 0:
            self.local = MemorySessionStore(
                settings.ttl_s,
                max_sessions=settings.local_copy_sessions,
                max_fingerprints=settings.local_copy_sessions * 32,
            )

    async def call(self, operation: Awaitable[T]) -> T:
        """Run one store operation; raises StoreUnavailable instead of the store's own errors."""
        if self._degraded and time.monotonic() < self._down_until:
            if asyncio.iscoroutine(operation):
                operation.close()
            raise StoreUnavailable()
        try:
            if self.store.in_process:
                # A coroutine that never waits cannot be timed out: a timer would only cost.
                result = await operation
            else:
                # Not asyncio.wait_for: before Python 3.12 it runs the operation as a task of its
                # own, two more turns of the event loop for every store call on the request path.
                # Each socket operation has operation_timeout_s (the Redis client's socket timeout:
                # a stalled Redis is taken for down within it); the whole call, a connection set up
                # and one retry on a fresh connection included, within four of it.
                async with asyncio.timeout(self._settings.operation_timeout_s * 4):
                    result = await operation
        except Exception as exc:
            first_failure = not self._degraded
            self._mark_down(exc)
            if first_failure:
                # Every pooled connection may lead to the dead server: without this, each would
                # fail once after the store came back, each failure another pass-through pause.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.store.reset(), timeout=self._settings.operation_timeout_s)
            raise StoreUnavailable(_answered(exc)) from exc
        if self._degraded:
            self._degraded = False
            self._metrics.store_up.set(1)
            logger.warning("session store recovered; session features are back")
            if self._pending_charges:
                self.spawn(self._flush_charges())
        return result

    def _mark_down(self, exc: BaseException) -> None:
        self._metrics.store_errors.inc()
        self._down_until = time.monotonic() + self._settings.retry_after_failure_s
        if not self._degraded:
            self._degraded = True
            self._metrics.store_up.set(0)
            logger.warning(
                "session store unavailable (%s): serving without sessions", _answered(exc) or type(exc).__name__
            )

    def explicit_id(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
        """The session the client names (a session header, ``prompt_cache_key``, ``user``), hashed; no I/O."""
        return explicit_session_id(
            headers,
            body,
            header_names=self._settings.headers,
            use_prompt_cache_key=self._settings.use_prompt_cache_key,
            use_user=self._settings.use_user,
        )

    async def resolve(
        self, tenant: str, messages: list[dict[str, Any]], explicit: str | None = None, *, lanes: bool = True
    ) -> SessionView:
        """``explicit``: the session the request names (:meth:`explicit_id`), or one the proxy itself
        knows it belongs to (a Responses chain); else the session is inferred from ``messages``.

        ``lanes``: a named request that does not extend the session's conversation is a side lane
        of it (:func:`_extends`); off for a session the proxy knows the request continues."""
        resumed = self._forwarded.resume(tenant, messages, "fingerprints")
        previous, shared = resumed.state, resumed.shared
        fingerprints, last, state = conversation_fingerprints(messages, previous, shared)
        resumed.keep(messages, state)
        # The conversation's last request, where its pairs went, and how many of them this one re-sends.
        sent = (previous.recorded, previous.counts[shared]) if previous is not None and shared else None
        try:
            view = await self._find(self.store, self.call, tenant, fingerprints, explicit, lanes, sent)
            if self.local is not None and view.record is not None:
                await self._newest_summary(view.record)
        except StoreUnavailable:
            if self.local is None:
                raise
            # The shared store cannot answer: what this replica knows of the session instead.
            view = await self._find(self.local, _direct, tenant, fingerprints, explicit, lanes)
            self._metrics.store_fallbacks.inc()
        view.last_message = last
        view.recorded = state.recorded
        view.fingerprinted = state
        return view

    async def _find(
        self,
        store: SessionStore,
        call: Callable[[Awaitable[Any]], Awaitable[Any]],
        tenant: str,
        fingerprints: list[int],
        explicit: str | None,
        lanes: bool = True,
        sent: tuple[Recorded, int] | None = None,
    ) -> SessionView:
        """``sent``: where the pairs of the conversation's last request went, and how many of them
        lead this request's fingerprints: those the session still holds (the in-process store
        says whether any of its pairs changed hands since) are not looked up, nor recorded again."""
        held = _held(store, tenant, fingerprints, sent)
        if explicit:
            record = await call(store.get(tenant, explicit))
            view = SessionView(tenant, explicit, record, fingerprints, set(), explicit=True)
            if lanes and record is not None and not await _extends(store, call, record, fingerprints):
                view.lane = fingerprints[0] if fingerprints else 0
            if held is not None and held[0] == explicit and record is not None and not view.side_lane:
                view.known_prefix = held[1]
            _tokened(store, view)
            return view
        # The last message is the new turn: only the history before it can identify a conversation,
        # so a request without history (a first message) always opens a new session.
        history = fingerprints[:-1]
        if not history:
            return SessionView(tenant, unique_id(), None, fingerprints)
        view = await self._found(store, call, tenant, fingerprints, history, held)
        _tokened(store, view)
        return view

    async def _found(
        self,
        store: SessionStore,
        call: Callable[[Awaitable[Any]], Awaitable[Any]],
        tenant: str,
        fingerprints: list[int],
        history: list[int],
        held: tuple[str, int] | None,
    ) -> SessionView:
        """The session the history's pairs name (:func:`vote`); ``held``: a session that holds the
        history's first pairs, which are not looked up.

        Where the request starts with the opening of another live session (:func:`opening_key`),
        it re-sends that conversation from its beginning: it is that session's where it continues
        the session's latest turn (:func:`_continues`), else it stays with the session its pairs
        name, as a conversation that only looks like part of it (``SessionView.opens_elsewhere``).
        A request that starts with the named session's own opening needs no more."""
        first = 0
        if held is not None:
            first = min(held[1], len(history))
            if await call(store.get(tenant, held[0])) is None:
                first = 0  # not live: its pairs name nothing, as a lookup would find
        # Whose opening the request's first pair is, looked up with the history's pairs: no round
        # trip of its own.
        start = fingerprints[0]
        matches, last_seen = await call(store.lookup(tenant, [*history[first:], opening_key(start)]))
        opener = matches.pop()
        counts = weights(matches, first + 1)
        if first:
            assert held is not None
            counts[held[0]] = counts.get(held[0], 0) + first * (first + 1) // 2
            if held[0] not in last_seen:
                record = await call(store.get(tenant, held[0]))
                last_seen = {**last_seen, held[0]: record.last_seen if record is not None else 0.0}
        session_id = elect(counts, last_seen)
        if session_id is None:
            return SessionView(tenant, unique_id(), None, fingerprints)
        record = await call(store.get(tenant, session_id))
        opens_elsewhere = False
        if opener is not None and opener != session_id and (record is None or record.opening != start):
            other = await call(store.get(tenant, opener))
            if other is not None and other.opening == start:
                if _continues(other, history):
                    session_id, record = opener, other
                else:
                    opens_elsewhere = True
        if record is not None and _forked(record, history):
            return SessionView(tenant, unique_id(), None, fingerprints)
        known = set(compress(history[first:], map(eq, matches, repeat(session_id))))
        view = SessionView(tenant, session_id, record, fingerprints, known, opens_elsewhere=opens_elsewhere)
        if first and held is not None and session_id == held[0]:
            view.known_prefix = first
        return view

    async def used(self, limit: UsageLimit, window_s: int) -> int:
        """What ``limit``'s key has spent in the current window."""
        return await self.call(self.store.usage(limit.key, window_s, time.time()))

    async def reserve(self, limits: list[UsageLimit], amount: int, window_s: int) -> Reservation:
        if not limits:
            return Reservation(True)
        return await self.call(self.store.reserve(limits, amount, window_s, time.time()))

    async def settle(self, reservation: Reservation | None, spent: int, window_s: int) -> None:
        """Correct a reservation to the ``spent`` tokens (the rest given back). Never raises: the
        store down, the reservation stands, as an over-count, never an under-count."""
        if reservation is None or not reservation.keys:
            return
        with contextlib.suppress(StoreUnavailable):
            await self.call(self.store.settle(reservation, spent - reservation.amount, window_s))

    async def charge_unreserved(self, limits: list[UsageLimit], spent: int, window_s: int) -> None:
        """Count what a request admitted without a reservation (the store was down) spent: now if
        the store answers, else once it does (kept per limit meanwhile, bounded). Budgets count
        every token, late rather than never. Never raises."""
        if not limits or spent <= 0:
            return
        try:
            await self.call(self.store.charge(limits, spent, window_s, time.time()))
        except StoreUnavailable:
            key = (tuple(limit.key for limit in limits), window_s)
            held = self._pending_charges.get(key)
            self._pending_charges[key] = (limits, spent + (held[1] if held else 0))

    async def _flush_charges(self) -> None:
        """The store is back: what was spent unreserved meanwhile goes on its counters."""
        pending = self._pending_charges
        while pending:
            key, (limits, spent) = pending.popitem()
            try:
                await self.call(self.store.charge(limits, spent, key[1], time.time()))
            except StoreUnavailable:
                # Back at the head, the first to flush next time: what is pending (queued meanwhile
                # or not) goes behind it.
                behind = [pending.popitem() for _ in range(len(pending))]
                pending[key] = (limits, spent)
                for other, charge in behind:
                    if other != key:
                        pending[other] = charge
                return

    async def record(
        self,
        view: SessionView,
        usage: Usage | None,
        reply: Mapping[str, Any] | None,
        messages: list[dict[str, Any]],
        request_bytes: int,
        reservation: Reservation | None,
        window_s: int,
    ) -> None:
        """Account one finished request. Never raises: a lost update only costs accuracy.

        A side lane counts its tokens and its request, and records no fingerprint (its pairs are not
        the session's conversation, which must not seem to extend it)."""
        new = [] if view.side_lane else _new_pairs(view)
        reply_fp = reply_fingerprint(messages, reply, view.last_message) if reply is not None else None
        if reply_fp is not None and not view.side_lane:
            new.append(reply_fp)
        # The session's opening, when the request opens the session or re-sends it: the index
        # entry that tells a conversation that starts there from a window slid over another.
        opening = 0
        if not view.side_lane and view.fingerprints:
            start = view.fingerprints[0]
            if view.record is None or view.record.opening == start:
                opening = start
        prompt = usage.prompt_tokens if usage else 0
        tokens_per_byte = prompt / request_bytes if usage and request_bytes > 0 else (view.tokens_per_byte or 0.0)
        turn = TurnRecord(
            prompt_tokens=prompt,
            cached_tokens=usage.cached_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            tokens_per_byte=tokens_per_byte,
            new_fingerprints=new,
            reply_pair=reply_fp or 0,
            request_pair=view.fingerprints[-1] if view.fingerprints else 0,
            first_pair=view.fingerprints[0] if view.fingerprints else 0,
            side_lane=view.side_lane,
            opening=opening,
            opening_key=opening_key(opening) if opening else 0,
        )
        now = time.time()
        if self.local is not None:
            await self.local.record_turn(view.tenant, view.session_id, turn, now)
        # Settle first: budget accuracy matters more than the session's counters. An answer
        # without (readable) usage keeps what it reserved: it is not free.
        if usage is not None:
            await self.settle(reservation, usage.total_tokens, window_s)
        with contextlib.suppress(StoreUnavailable):
            await self.call(self.store.record_turn(view.tenant, view.session_id, turn, now))
            _recorded(self.store, view, reply_fp)

    async def _newest_summary(self, record: SessionRecord) -> None:
        """A summary this replica made while the store was down is newer than the store's: it wins
        (and is written back), so the conversation does not fall back to an older, longer one."""
        assert self.local is not None
        mine = await self.local.get(record.tenant, record.session_id)
        if mine is None or not mine.summary:
            return
        if int(mine.summary.get("version", 0)) > int((record.summary or {}).get("version", 0)):
            record.summary = mine.summary
            with contextlib.suppress(StoreUnavailable):
                await self.call(self.store.set_summary(record.tenant, record.session_id, mine.summary))

    async def _write_both(self, operation: Callable[[SessionStore], Awaitable[None]]) -> None:
        """Write to this replica's copy, then to the store (raises :class:`StoreUnavailable`): the
        copy keeps it either way."""
        if self.local is not None:
            await operation(self.local)
        await self.call(operation(self.store))

    async def _read_either(self, operation: Callable[[SessionStore], Awaitable[T]]) -> T:
        """Read from the store, or (store down) from this replica's copy; raises
        :class:`StoreUnavailable` only when neither can say."""
        try:
            return await self.call(operation(self.store))
        except StoreUnavailable:
            if self.local is None:
                raise
            return await operation(self.local)

    async def put_response(self, tenant: str, response_id: str, info: dict[str, Any], ttl_s: float) -> None:
        """Remember where a stored response lives, so its owner can use it while the store is down."""
        await self._write_both(lambda store: store.put_response(tenant, response_id, info, ttl_s))

    async def get_response(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        """Where a stored response lives: the store's word, or this replica's copy (the store down,
        or the response made while it was). :class:`StoreUnavailable` when the store is down and this
        replica has no copy: then only the store could say whether it exists, and whose it is."""
        try:
            found = await self.call(self.store.get_response(tenant, response_id))
        except StoreUnavailable:
            found = await self.local.get_response(tenant, response_id) if self.local is not None else None
            if found is None:
                raise
            return found
        if found is None and self.local is not None:
            found = await self.local.get_response(tenant, response_id)
        return found

    async def set_summary(self, tenant: str, session_id: str, summary: dict[str, Any] | None) -> None:
        """Store a session's summary, kept here too: the conversation keeps it while the store is down."""
        await self._write_both(lambda store: store.set_summary(tenant, session_id, summary))

    async def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        """A session's record from the store, or (store down) this replica's copy of it."""
        return await self._read_either(lambda store: store.get(tenant, session_id))

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run session bookkeeping in the background (from synchronous code: the end of a stream;
        compactions), until :meth:`drain`."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait for the background work, including what it starts meanwhile (a finished turn's
        compaction)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


async def _direct(operation: Awaitable[T]) -> T:
    return await operation


def _held(
    store: SessionStore, tenant: str, fingerprints: list[int], sent: tuple[Recorded, int] | None
) -> tuple[str, int] | None:
    """The session that holds the first pairs of ``fingerprints`` and how many: those of the
    conversation's last request that this one re-sends (and that request's reply pair, next), where
    the in-process store says none of the session's pairs changed hands since they were recorded."""
    if sent is None or not isinstance(store, MemorySessionStore):
        return None
    recorded, shared_pairs = sent
    session_id = recorded.session_id
    if session_id is None or recorded.tenant != tenant or store.pair_token(tenant, session_id) != recorded.token:
        return None
    count = min(recorded.pairs, shared_pairs)
    if count == recorded.pairs and count < len(fingerprints) and fingerprints[count] == recorded.reply_pair:
        count += 1
    return (session_id, count) if count else None


def _tokened(store: SessionStore, view: SessionView) -> None:
    """The in-process store's token for the session as found (``MemorySessionStore.pair_token``)."""
    if isinstance(store, MemorySessionStore) and not view.side_lane:
        view.token = store.pair_token(view.tenant, view.session_id)


def _new_pairs(view: SessionView) -> list[int]:
    """The request's pairs its session does not hold yet (each once)."""
    fingerprints, known, prefix = view.fingerprints, view.known, view.known_prefix
    fresh = [fp for fp in fingerprints[prefix:] if fp not in known]
    if fresh and prefix:
        if len(fresh) <= FEW_NEW_PAIRS:
            # A turn adds a pair or two: each looked for among those held (a scan in C), not a set
            # of the whole history made every request.
            fresh = [fp for fp in fresh if not _among(fingerprints, fp, prefix)]
        else:
            held = set(fingerprints[:prefix])
            fresh = [fp for fp in fresh if fp not in held]
    return fresh


FEW_NEW_PAIRS = 4


def _among(items: list[int], item: int, count: int) -> bool:
    """Whether ``item`` is one of the first ``count`` of ``items``."""
    try:
        items.index(item, 0, count)
    except ValueError:
        return False
    return True


def _recorded(store: SessionStore, view: SessionView, reply_pair: int | None) -> None:
    """Every pair of the recorded request (and its reply's) is the session's now, unless one of
    the session's pairs changed hands while the request was in flight: say so for the next."""
    if view.recorded is None or view.side_lane or view.token is None or not isinstance(store, MemorySessionStore):
        return
    token = store.pair_token(view.tenant, view.session_id)
    if token == view.token:
        recorded = view.recorded
        recorded.tenant, recorded.session_id, recorded.token = view.tenant, view.session_id, token
        recorded.pairs, recorded.reply_pair = len(view.fingerprints), reply_pair or 0


async def _extends(
    store: SessionStore,
    call: Callable[[Awaitable[Any]], Awaitable[Any]],
    record: SessionRecord,
    fingerprints: list[int],
) -> bool:
    """Whether a request naming a session continues that session's conversation.

    It does when the session has no turn yet, when it opens as the session's latest request did
    (its first pair), or when its history (the pairs before its newest message) shares a pair with
    the conversation: a window that slid still re-sends later pairs. The latest request's and
    reply's pairs are on the record; only a request that shares neither, nor the first pair, costs a
    lookup of its history (one store round trip). Anything else (a title or tags request that
    quotes the chat as text, a sub-agent with a conversation of its own) is a side lane.
    """
    if not record.requests or not record.first_pair:
        return True
    if fingerprints and fingerprints[0] == record.first_pair:
        return True
    history = fingerprints[:-1]
    if not history:
        return False
    if (record.last_pair and record.last_pair in history) or (
        record.last_request_pair and record.last_request_pair in history
    ):
        return True
    matches, _ = await call(store.lookup(record.tenant, history))
    return record.session_id in matches


def _continues(record: SessionRecord, history: list[int]) -> bool:
    """Whether a history that starts with the session's opening continues the session's latest turn:
    it re-sends the latest reply, or the latest request's newest pair past the opening itself (which
    every conversation that opens alike shares)."""
    if record.last_pair and record.last_pair in history:
        return True
    return bool(record.last_request_pair) and record.last_request_pair in history[1:]


def _forked(record: SessionRecord, history: list[int]) -> bool:
    """The request shares pairs with the session but continues neither its latest request nor reply.

    That is another conversation that began the same way (or a regenerated answer): it gets a
    session of its own. A client that alters the model's reply still re-sends the latest request.
    """
    if not record.last_pair and not record.last_request_pair:
        return False
    # Most often near the end of the history (the latest turn), looked for there first.
    recent = history[-8:]
    if record.last_pair in recent or record.last_request_pair in recent:
        return False
    return record.last_pair not in history and record.last_request_pair not in history
