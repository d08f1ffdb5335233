"""In-memory session store: the default, for one proxy process.

Single-threaded asyncio makes every method atomic (none awaits in between its
reads and writes), which gives the same guarantees the Redis store gets from
transactions and Lua.
"""

from __future__ import annotations

import itertools
import operator
import struct
import time
import uuid
from collections import OrderedDict
from dataclasses import fields
from itertools import repeat
from typing import Any

from cachetools import TLRUCache, TTLCache

from proxy.recent import peek
from proxy.sessions.model import Reservation, SessionRecord, TurnRecord, UsageLimit
from proxy.sessions.store import window_of


def _tenant_key(tenant: str, fingerprint: int) -> int:
    """One int for (tenant, pair): tenants never share an entry (a 64-bit hash collision aside, and
    a match is only used once the session is found under the same tenant)."""
    return hash((tenant, fingerprint))


# A record's numbers, packed: ~130 bytes instead of ~450 for the record object and its float and
# int objects (100,000 sessions: -30 MiB). Summaries (rare) are kept beside them. Every number of a
# record is a float or a non-negative int (counts, 64-bit pair hashes).
_NUMBERS = [f for f in fields(SessionRecord) if f.type in ("int", "float")]
_PACKED_FIELDS = tuple(f.name for f in _NUMBERS)
_PACKED = struct.Struct("<" + "".join("d" if f.type == "float" else "Q" for f in _NUMBERS))
_NUMBERS_OF = operator.attrgetter(*_PACKED_FIELDS)
_LAST_SEEN = struct.Struct("<d")
_LAST_SEEN_OFFSET = 8 * _PACKED_FIELDS.index("last_seen")
_CONTEXT_TOKENS = struct.Struct("<Q")
_CONTEXT_TOKENS_OFFSET = 8 * _PACKED_FIELDS.index("context_tokens")

SessionKey = tuple[str, str]


def _pack(record: SessionRecord) -> bytes:
    return _PACKED.pack(*_NUMBERS_OF(record))


def _last_seen(packed: bytes) -> float:
    last_seen: float = _LAST_SEEN.unpack_from(packed, _LAST_SEEN_OFFSET)[0]
    return last_seen


class MemorySessionStore:
    in_process = True

    def __init__(self, ttl_s: float, max_sessions: int = 100_000, max_fingerprints: int = 2_000_000) -> None:
        self._ttl = ttl_s
        # Packed records (least recently written first) and the summaries of those that have one. An
        # OrderedDict, not a cachetools cache: stats and list_sessions read it newest first, in order.
        self._sessions: OrderedDict[SessionKey, bytes] = OrderedDict()
        self._summaries: dict[SessionKey, dict[str, Any]] = {}
        # Per tenant, its sessions' ids in the order above: a tenant's newest are listed without a
        # pass over every tenant's sessions (the operator page lists each tenant's).
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}
        # Pair fingerprint (folded with the tenant) -> session id, oldest first. One int key and the
        # record's own id string per pair: 100,000 sessions of a few pairs each cost ~30 MiB, not ~60.
        # A pair is live while its session is (the record's last_seen and the TTL decide).
        self._fingerprints: dict[int, str] = {}
        # Per session, how many of its pairs another session took since (a pair recorded again in
        # another conversation); and a count of the times pairs were forgotten otherwise (past
        # max_fingerprints, or the counts themselves cleared): while both read the same, a session
        # still holds every pair it held (``pair_token``).
        self._taken: dict[SessionKey, int] = {}
        self._pairs_forgotten = 0
        self._usage: dict[tuple[str, int], int] = {}
        self._locks: dict[str, tuple[str, float]] = {}
        # Least recently used out; each for the TTL from when it was last set.
        self._route_headers: TTLCache[str, dict[str, str]] = TTLCache(max_sessions, ttl_s, timer=time.time)
        self._max_sessions = max_sessions
        self._max_fingerprints = max_fingerprints
        # (info, expires at): least recently stored out (reading one is no use), each until it expires.
        self._responses: TLRUCache[tuple[str, str], tuple[dict[str, Any], float]] = TLRUCache(
            max_sessions, ttu=lambda _key, entry, _now: entry[1], timer=time.time
        )
        self._secrets: dict[str, str] = {}

    async def ping(self) -> bool:
        return True

    def _record(self, key: SessionKey, packed: bytes) -> SessionRecord:
        numbers = dict(zip(_PACKED_FIELDS, _PACKED.unpack(packed), strict=True))
        return SessionRecord(key[0], key[1], **numbers, summary=self._summaries.get(key))

    def _live(self, key: SessionKey, now: float) -> bytes | None:
        packed = self._sessions.get(key)
        if packed is None:
            return None
        if now - _last_seen(packed) > self._ttl:
            self._forget(key)
            return None
        return packed

    def _forget(self, key: SessionKey) -> bool:
        self._summaries.pop(key, None)
        self._unindex(key)
        return self._sessions.pop(key, None) is not None

    def _unindex(self, key: SessionKey) -> None:
        ids = self._by_tenant.get(key[0])
        if ids is not None:
            ids.pop(key[1], None)
            if not ids:
                del self._by_tenant[key[0]]

    def _keep_summary(self, key: SessionKey, summary: dict[str, Any] | None) -> None:
        if summary is None:
            self._summaries.pop(key, None)
        else:
            self._summaries[key] = summary

    def _store(self, record: SessionRecord) -> None:
        key = (record.tenant, record.session_id)
        self._sessions[key] = _pack(record)
        self._sessions.move_to_end(key)
        ids = self._by_tenant.setdefault(record.tenant, OrderedDict())
        ids[record.session_id] = None
        ids.move_to_end(record.session_id)
        self._keep_summary(key, record.summary)
        while len(self._sessions) > self._max_sessions:
            oldest, _ = self._sessions.popitem(last=False)
            self._summaries.pop(oldest, None)
            self._unindex(oldest)

    async def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        key = (tenant, session_id)
        packed = self._live(key, time.time())
        return self._record(key, packed) if packed else None

    async def lookup(self, tenant: str, fingerprints: list[int]) -> tuple[list[str | None], dict[str, float]]:
        now = time.time()
        # In passes of C: each pair's key (``_tenant_key``) and session, each session's record read
        # once (a conversation's pairs all name the same session), the sessions not live left out.
        found = list(map(self._fingerprints.get, map(hash, zip(repeat(tenant), fingerprints))))
        live: dict[str | None, str | None] = {None: None}
        last_seen: dict[str, float] = {}
        for session_id in dict.fromkeys(found):
            if session_id is not None:
                packed = self._live((tenant, session_id), now) if session_id else None
                live[session_id] = session_id if packed else None
                if packed:
                    last_seen[session_id] = _last_seen(packed)
        return list(map(live.__getitem__, found)), last_seen

    def pair_token(self, tenant: str, session_id: str) -> tuple[int, int]:
        """What changes when a pair of the session may have stopped being its own (taken by another
        session, or forgotten): two reads that agree mean it holds every pair it held."""
        return self._taken.get((tenant, session_id), 0), self._pairs_forgotten

    async def record_turn(self, tenant: str, session_id: str, turn: TurnRecord, now: float) -> None:
        key = (tenant, session_id)
        packed = self._live(key, now)
        record = self._record(key, packed) if packed else SessionRecord(tenant, session_id, created=now)
        record.last_seen = now
        record.requests += 1
        record.prompt_tokens += turn.prompt_tokens
        record.cached_tokens += turn.cached_tokens
        record.completion_tokens += turn.completion_tokens
        record.tokens_per_byte = turn.tokens_per_byte
        record.fingerprints += len(turn.new_fingerprints)
        if not turn.side_lane:
            record.context_tokens = turn.prompt_tokens
            record.last_pair = turn.reply_pair
            record.last_request_pair = turn.request_pair
            record.first_pair = turn.first_pair
        if turn.opening and not record.opening:
            record.opening = turn.opening
        self._store(record)
        if turn.opening_key:
            # A conversation's opening, not one of its pairs: whose it is moves no session's pair
            # token (the identity's shortcut never reads it). Re-inserted: the newest again.
            opening_key = _tenant_key(tenant, turn.opening_key)
            self._fingerprints.pop(opening_key, None)
            self._fingerprints[opening_key] = session_id
        for fingerprint in turn.new_fingerprints:
            fingerprint_key = _tenant_key(tenant, fingerprint)
            holder = self._fingerprints.pop(fingerprint_key, None)  # re-inserted: the newest again
            self._fingerprints[fingerprint_key] = session_id
            if holder is not None and holder != session_id:
                self._taken[(tenant, holder)] = self._taken.get((tenant, holder), 0) + 1
        if len(self._fingerprints) > self._max_fingerprints:
            # Forget the oldest tenth at once: a dict has no cheap "pop the oldest" one at a time.
            excess = len(self._fingerprints) - self._max_fingerprints + self._max_fingerprints // 10
            for fingerprint_key in list(itertools.islice(self._fingerprints, excess)):
                del self._fingerprints[fingerprint_key]
            self._pairs_forgotten += 1
        if len(self._taken) > self._max_sessions:
            self._taken.clear()
            self._pairs_forgotten += 1

    async def list_sessions(self, tenant: str, limit: int = 100) -> list[SessionRecord]:
        now = time.time()
        records = []
        for session_id in reversed(self._by_tenant.get(tenant, {})):
            key = (tenant, session_id)
            packed = self._sessions.get(key)
            if packed is None or now - _last_seen(packed) > self._ttl:
                continue
            records.append(self._record(key, packed))
            if len(records) == limit:
                break
        return records

    async def delete(self, tenant: str, session_id: str) -> bool:
        return self._forget((tenant, session_id))

    async def set_summary(self, tenant: str, session_id: str, summary: dict[str, Any] | None) -> None:
        key, now = (tenant, session_id), time.time()
        if self._live(key, now) is None:
            self._store(SessionRecord(tenant, session_id, created=now, last_seen=now, summary=summary))
        else:
            self._keep_summary(key, summary)

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

    async def charge(self, limits: list[UsageLimit], amount: int, window_s: int, now: float) -> None:
        window = window_of(now, window_s)[0]
        for limit in limits:
            self._usage[(limit.key, window)] = self._usage.get((limit.key, window), 0) + amount

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

    async def get_route_headers(self, digest: str) -> dict[str, str] | None:
        headers = self._route_headers.get(digest)
        return None if headers is None else dict(headers)

    async def set_route_headers(self, digest: str, headers: dict[str, str]) -> None:
        self._route_headers[digest] = dict(headers)

    async def stats(self, since: float) -> tuple[int, int]:
        # Newest first, stopping at the first record seen before ``since``: records are kept in the
        # order they were last written, so this reads the active sessions only (the gauge refresh
        # would otherwise hold the event loop for every session kept, 100,000 by default).
        active = context_tokens = 0
        for packed in reversed(self._sessions.values()):
            if _last_seen(packed) < since:
                break
            active += 1
            context_tokens += _CONTEXT_TOKENS.unpack_from(packed, _CONTEXT_TOKENS_OFFSET)[0]
        return active, context_tokens

    async def reset(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def put_response(self, tenant: str, response_id: str, info: dict[str, Any], ttl_s: float) -> None:
        self._responses[(tenant, response_id)] = (dict(info), time.time() + ttl_s)

    async def shared_secret(self, name: str, candidate: str) -> str:
        return self._secrets.setdefault(name, candidate)

    async def get_response(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        entry = peek(self._responses, (tenant, response_id))
        return None if entry is None else dict(entry[0])
