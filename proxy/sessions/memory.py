"""In-memory session store: the default, for one proxy process.

Single-threaded asyncio makes every method atomic (none awaits in between its
reads and writes), which gives the same guarantees the Redis store gets from
transactions and Lua.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from proxy.sessions.model import Reservation, SessionRecord, TurnRecord, UsageLimit
from proxy.sessions.store import window_of


class MemorySessionStore:
    def __init__(self, ttl_s: float, max_sessions: int = 100_000, max_fingerprints: int = 2_000_000) -> None:
        self._ttl = ttl_s
        self._sessions: OrderedDict[tuple[str, str], SessionRecord] = OrderedDict()
        self._fingerprints: OrderedDict[tuple[str, int], tuple[str, float]] = OrderedDict()
        self._usage: dict[tuple[str, int], int] = {}
        self._locks: dict[str, tuple[str, float]] = {}
        self._max_sessions = max_sessions
        self._max_fingerprints = max_fingerprints

    async def ping(self) -> bool:
        return True

    def _live(self, tenant: str, session_id: str, now: float) -> SessionRecord | None:
        record = self._sessions.get((tenant, session_id))
        if record is None:
            return None
        if now - record.last_seen > self._ttl:
            del self._sessions[(tenant, session_id)]
            return None
        return record

    async def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        record = self._live(tenant, session_id, time.time())
        return replace(record) if record else None

    async def lookup(self, tenant: str, fingerprints: list[int]) -> tuple[list[str | None], dict[str, float]]:
        now = time.time()
        matches: list[str | None] = []
        for fingerprint in fingerprints:
            entry = self._fingerprints.get((tenant, fingerprint))
            matches.append(entry[0] if entry and entry[1] > now else None)
        last_seen = {}
        for session_id in {m for m in matches if m}:
            record = self._live(tenant, session_id, now)
            last_seen[session_id] = record.last_seen if record else 0.0
        return matches, last_seen

    async def record_turn(self, tenant: str, session_id: str, turn: TurnRecord, now: float) -> None:
        record = self._live(tenant, session_id, now) or SessionRecord(tenant, session_id, created=now)
        record.last_seen = now
        record.requests += 1
        record.prompt_tokens += turn.prompt_tokens
        record.cached_tokens += turn.cached_tokens
        record.completion_tokens += turn.completion_tokens
        record.context_tokens = turn.prompt_tokens
        record.tokens_per_byte = turn.tokens_per_byte
        record.fingerprints += len(turn.new_fingerprints)
        record.last_pair = turn.reply_pair
        record.last_request_pair = turn.request_pair
        self._sessions[(tenant, session_id)] = record
        self._sessions.move_to_end((tenant, session_id))
        expires = now + self._ttl
        for fingerprint in turn.new_fingerprints:
            self._fingerprints[(tenant, fingerprint)] = (session_id, expires)
            self._fingerprints.move_to_end((tenant, fingerprint))
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
        while len(self._fingerprints) > self._max_fingerprints:
            self._fingerprints.popitem(last=False)

    async def list_sessions(self, tenant: str, limit: int = 100) -> list[SessionRecord]:
        now = time.time()
        records = [
            replace(r)
            for (t, _), r in reversed(self._sessions.items())
            if t == tenant and now - r.last_seen <= self._ttl
        ]
        return records[:limit]

    async def delete(self, tenant: str, session_id: str) -> bool:
        return self._sessions.pop((tenant, session_id), None) is not None

    async def set_summary(self, tenant: str, session_id: str, summary: dict[str, Any] | None) -> None:
        now = time.time()
        record = self._live(tenant, session_id, now)
        if record is None:
            record = SessionRecord(tenant, session_id, created=now, last_seen=now)
            self._sessions[(tenant, session_id)] = record
        record.summary = summary

    async def reserve(self, limits: list[UsageLimit], amount: int, window_s: int, now: float) -> Reservation:
        window, retry_after = window_of(now, window_s)
        self._expire_usage(window)
        for limit in limits:
            if self._usage.get((limit.key, window), 0) + amount > limit.limit:
                return Reservation(False, rejected_kind=limit.kind, retry_after_s=retry_after)
        for limit in limits:
            self._usage[(limit.key, window)] = self._usage.get((limit.key, window), 0) + amount
        return Reservation(True, amount, tuple(limit.key for limit in limits), window=window)

    async def settle(self, reservation: Reservation, delta: int, window_s: int) -> None:
        for key in reservation.keys:
            slot = (key, reservation.window)
            self._usage[slot] = max(0, self._usage.get(slot, 0) + delta)

    async def usage(self, key: str, window_s: int, now: float) -> int:
        return self._usage.get((key, window_of(now, window_s)[0]), 0)

    def _expire_usage(self, window: int) -> None:
        if len(self._usage) > 10_000:
            for key in [k for k in self._usage if k[1] < window]:
                del self._usage[key]

    async def acquire_lock(self, name: str, ttl_s: float) -> str | None:
        now = time.monotonic()
        held = self._locks.get(name)
        if held and held[1] > now:
            return None
        token = uuid.uuid4().hex
        self._locks[name] = (token, now + ttl_s)
        return token

    async def release_lock(self, name: str, token: str) -> None:
        held = self._locks.get(name)
        if held and held[0] == token:
            del self._locks[name]

    async def stats(self, since: float) -> tuple[int, int]:
        active = [r for r in self._sessions.values() if r.last_seen >= since]
        return len(active), sum(r.context_tokens for r in active)

    async def aclose(self) -> None:
        return None
