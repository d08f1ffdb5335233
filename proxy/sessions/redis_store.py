"""Redis session store: shared by every proxy replica.

Layout (``p`` = configured key prefix, tenant-namespaced everywhere):
  p s:<tenant>:<sid>       hash   the session record (summary as JSON)
  p fp:<tenant>:<hex>      string session id of one adjacent-message fingerprint, or of the
                                  session a conversation opening opened (identity.opening_key)
  p idx:<tenant>           zset   session ids by last-seen (listing)
  p active                 zset   "<tenant>\\0<sid>" by last-seen (gauges)
  p u:<scope>:<window>     string tokens used in one budget window
  p lock:<name>            string lock token (SET NX PX)
  p rt:<digest>            string headers a router asked to be echoed, per routing key (JSON)
  p canon                  stream the replicas' shared canonicalizer memories (proxy/replicas)
  p secret:<name>          string a secret the replicas share (the cache-salt key), no TTL
Every key but the secrets carries a TTL. Turn recording is one MULTI/EXEC transaction; budget
admission is one Lua script (check every limit, then reserve on all or none).

On a Redis Cluster (``cluster=True``) a script or transaction may only touch keys of one hash
slot. The budget keys of one admission share a hash tag (``{tenant}``, set by
proxy.chat.budget.usage_limits), so the admission script stays one atomic step; a turn's session hash
is updated in a transaction of its own and its indexes and fingerprints beside it (each of those
writes is atomic by itself, and none is read together with another); fingerprints are read with
one GET per slot instead of one MGET.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from proxy.sessions.connect import RedisClient, drop_connections, redis_client
from proxy.sessions.model import Reservation, SessionRecord, TurnRecord, UsageLimit
from proxy.sessions.store import window_of

_RESERVE = """
local amount = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
for i, key in ipairs(KEYS) do
  local used = tonumber(redis.call('GET', key) or '0')
  if used + amount > tonumber(ARGV[2 + i]) then return i end
end
for _, key in ipairs(KEYS) do
  redis.call('INCRBY', key, amount)
  redis.call('EXPIRE', key, ttl)
end
return 0
"""

# Settling corrects a reservation that may no longer exist: Redis restarted (or failed over to a
# replica that never saw it) between reserve and settle. A plain INCRBY would then create the key
# with a negative count and no TTL: free budget, for ever. Only what exists is corrected, never
# below zero, and the key always keeps a TTL.
_SETTLE = """
local delta = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    if redis.call('INCRBY', key, delta) < 0 then redis.call('SET', key, 0, 'KEEPTTL') end
    if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ttl) end
  elseif delta > 0 then
    redis.call('SET', key, delta, 'EX', ttl)
  end
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_INT_FIELDS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "context_tokens",
    "fingerprints",
    "last_pair",
    "last_request_pair",
    "first_pair",
    "opening",
)


# The active sessions whose context the gauges' refresh reads (the rest scaled from them).
STATS_SAMPLE = 1000


class RedisSessionStore:
    in_process = False

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        ttl_s: int,
        timeout_s: float = 0.25,
        sentinels: Sequence[str] = (),
        sentinel_service: str = "mymaster",
        sentinel_password: str | None = None,
        cluster: bool = False,
    ) -> None:
        self._redis: RedisClient = redis_client(
            url,
            timeout_s,
            sentinels=sentinels,
            service=sentinel_service,
            sentinel_password=sentinel_password,
            cluster=cluster,
        )
        self._cluster = isinstance(self._redis, RedisCluster)
        self._prefix = prefix
        self._ttl = ttl_s
        self._reserve = self._redis.register_script(_RESERVE)
        self._release = self._redis.register_script(_RELEASE)
        self._settle = self._redis.register_script(_SETTLE)

    @property
    def client(self) -> RedisClient:
        return self._redis

    def _session_key(self, tenant: str, session_id: str) -> str:
        return f"{self._prefix}s:{tenant}:{session_id}"

    def _fp_key(self, tenant: str, fingerprint: int) -> str:
        return f"{self._prefix}fp:{tenant}:{fingerprint:016x}"

    def usage_key(self, key: str, window: int) -> str:
        return f"{self._prefix}u:{key}:{window}"

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    async def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        data = await self._redis.hgetall(self._session_key(tenant, session_id))
        return _record(tenant, session_id, {str(k): str(v) for k, v in data.items()}) if data else None

    async def lookup(self, tenant: str, fingerprints: list[int]) -> tuple[list[str | None], dict[str, float]]:
        if not fingerprints:
            return [], {}
        keys = [self._fp_key(tenant, f) for f in fingerprints]
        # On a cluster the fingerprints are spread over slots: one GET per slot, not one MGET.
        if isinstance(self._redis, RedisCluster):
            raw = await self._redis.mget_nonatomic(keys)
        else:
            raw = await self._redis.mget(keys)
        matches: list[str | None] = [str(m) if m else None for m in raw]
        candidates = sorted({m for m in matches if m})
        last_seen: dict[str, float] = {}
        if len(candidates) > 1:
            scores = await self._redis.zmscore(f"{self._prefix}idx:{tenant}", candidates)
            last_seen = {sid: float(score or 0.0) for sid, score in zip(candidates, scores, strict=True)}
        return matches, last_seen

    async def record_turn(self, tenant: str, session_id: str, turn: TurnRecord, now: float) -> None:
        key = self._session_key(tenant, session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, "created", now)
            pipe.hset(key, mapping={"last_seen": now, "tokens_per_byte": turn.tokens_per_byte})
            pipe.hincrby(key, "requests", 1)
            pipe.hincrby(key, "prompt_tokens", turn.prompt_tokens)
            pipe.hincrby(key, "cached_tokens", turn.cached_tokens)
            pipe.hincrby(key, "completion_tokens", turn.completion_tokens)
            pipe.hincrby(key, "fingerprints", len(turn.new_fingerprints))
            if not turn.side_lane:
                # A side lane leaves the conversation's place as it was (as the memory store does).
                pipe.hset(
                    key,
                    mapping={
                        "context_tokens": turn.prompt_tokens,
                        "last_pair": turn.reply_pair,
                        "last_request_pair": turn.request_pair,
                        "first_pair": turn.first_pair,
                    },
                )
            if turn.opening:
                pipe.hsetnx(key, "opening", turn.opening)
            pipe.expire(key, self._ttl)
            if self._cluster:
                # One slot per transaction: the indexes and fingerprints live elsewhere.
                await pipe.execute()
                await self._index_turn(tenant, session_id, turn, now)
                return
            self._queue_index(pipe, tenant, session_id, turn, now)
            await pipe.execute()

    async def _index_turn(self, tenant: str, session_id: str, turn: TurnRecord, now: float) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            self._queue_index(pipe, tenant, session_id, turn, now)
            await pipe.execute()

    def _queue_index(self, pipe: Any, tenant: str, session_id: str, turn: TurnRecord, now: float) -> None:
        index = f"{self._prefix}idx:{tenant}"
        pipe.zadd(index, {session_id: now})
        # The sessions it lists live ttl_s after their last turn: the ones older are gone (their
        # records expired), and would otherwise stay while the tenant keeps sending.
        pipe.zremrangebyscore(index, "-inf", f"({now - self._ttl}")
        pipe.expire(index, self._ttl)
        pipe.zadd(f"{self._prefix}active", {f"{tenant}\x00{session_id}": now})
        for fingerprint in turn.new_fingerprints:
            pipe.set(self._fp_key(tenant, fingerprint), session_id, ex=self._ttl)
        if turn.opening_key:
            # A conversation's opening (identity.opening_key): set again by every request that
            # re-sends it, so it lives as long as the conversation does.
            pipe.set(self._fp_key(tenant, turn.opening_key), session_id, ex=self._ttl)

    async def list_sessions(self, tenant: str, limit: int = 100) -> list[SessionRecord]:
        index = f"{self._prefix}idx:{tenant}"
        session_ids = [str(sid) for sid in await self._redis.zrevrange(index, 0, limit - 1)]
        if not session_ids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for session_id in session_ids:
                pipe.hgetall(self._session_key(tenant, session_id))
            rows = await pipe.execute()
        stale = [sid for sid, data in zip(session_ids, rows, strict=True) if not data]
        if stale:
            await self._redis.zrem(index, *stale)
        return [_record(tenant, sid, data) for sid, data in zip(session_ids, rows, strict=True) if data]

    async def delete(self, tenant: str, session_id: str) -> bool:
        # Three keys in three slots on a cluster: no transaction there (an index entry left behind
        # for a moment is cleaned up by the listing, which drops ids whose record is gone).
        async with self._redis.pipeline(transaction=not self._cluster) as pipe:
            pipe.delete(self._session_key(tenant, session_id))
            pipe.zrem(f"{self._prefix}idx:{tenant}", session_id)
            pipe.zrem(f"{self._prefix}active", f"{tenant}\x00{session_id}")
            deleted, _, _ = await pipe.execute()
        return bool(deleted)

    async def set_summary(self, tenant: str, session_id: str, summary: dict[str, Any] | None) -> None:
        key = self._session_key(tenant, session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            if summary is None:
                pipe.hdel(key, "summary")
            else:
                pipe.hset(key, "summary", json.dumps(summary, ensure_ascii=False))
            pipe.expire(key, self._ttl)
            await pipe.execute()

    async def reserve(self, limits: list[UsageLimit], amount: int, window_s: int, now: float) -> Reservation:
        window, retry_after = window_of(now, window_s)
        keys = [self.usage_key(limit.key, window) for limit in limits]
        rejected = int(await self._reserve(keys=keys, args=[amount, window_s + 60, *[lim.limit for lim in limits]]))
        if rejected:
            return Reservation(False, rejected_kind=limits[rejected - 1].kind, retry_after_s=retry_after)
        return Reservation(True, amount, tuple(keys), window=window)

    async def settle(self, reservation: Reservation, delta: int, window_s: int) -> None:
        if delta == 0 or not reservation.keys:
            return
        await self._settle(keys=list(reservation.keys), args=[delta, window_s + 60])

    async def charge(self, limits: list[UsageLimit], amount: int, window_s: int, now: float) -> None:
        if amount <= 0 or not limits:
            return
        window = window_of(now, window_s)[0]
        keys = [self.usage_key(limit.key, window) for limit in limits]
        await self._settle(keys=keys, args=[amount, window_s + 60])

    async def usage(self, key: str, window_s: int, now: float) -> int:
        value = await self._redis.get(self.usage_key(key, window_of(now, window_s)[0]))
        return int(value or 0)

    async def acquire_lock(self, name: str, ttl_s: float) -> str | None:
        token = uuid.uuid4().hex
        acquired = await self._redis.set(f"{self._prefix}lock:{name}", token, nx=True, px=int(ttl_s * 1000))
        return token if acquired else None

    async def release_lock(self, name: str, token: str) -> None:
        await self._release(keys=[f"{self._prefix}lock:{name}"], args=[token])

    async def shared_secret(self, name: str, candidate: str) -> str:
        key = f"{self._prefix}secret:{name}"
        # SET NX then GET: whichever replica writes first, every one reads the same value.
        await self._redis.set(key, candidate, nx=True)
        stored = await self._redis.get(key)
        return str(stored) if stored else candidate

    async def get_route_headers(self, digest: str) -> dict[str, str] | None:
        raw = await self._redis.get(f"{self._prefix}rt:{digest}")
        if not raw:
            return None
        try:
            headers = json.loads(raw)
        except ValueError:
            return None
        return {str(k): str(v) for k, v in headers.items()} if isinstance(headers, dict) else None

    async def set_route_headers(self, digest: str, headers: dict[str, str]) -> None:
        await self._redis.set(f"{self._prefix}rt:{digest}", json.dumps(headers), ex=self._ttl)

    async def stats(self, since: float) -> tuple[int, int]:
        active_key = f"{self._prefix}active"
        await self._redis.zremrangebyscore(active_key, "-inf", since - self._ttl)
        active = int(await self._redis.zcount(active_key, since, "+inf"))
        if not active:
            return 0, 0
        # The context the active sessions hold, read from the most recent of them and scaled to all:
        # a gauge's refresh reads a bounded sample, not every session (10,000 reads at once before,
        # and a count that stopped there).
        members = [
            str(m) for m in await self._redis.zrevrangebyscore(active_key, "+inf", since, start=0, num=STATS_SAMPLE)
        ]
        async with self._redis.pipeline(transaction=False) as pipe:
            for member in members:
                tenant, _, session_id = member.partition("\x00")
                pipe.hget(self._session_key(tenant, session_id), "context_tokens")
            values = await pipe.execute()
        sampled = sum(int(v or 0) for v in values)
        return active, sampled if len(members) >= active else round(sampled * active / max(1, len(members)))

    async def tenant_by_digest(self, digest: str) -> str | None:
        """A tenant provisioned in Redis: JSON {name, upstream_api_key?, budget?} under its key's SHA-256."""
        value = await self._redis.get(f"{self._prefix}tenant:{digest}")
        return str(value) if value else None

    def _response_key(self, tenant: str, response_id: str) -> str:
        return f"{self._prefix}r:{tenant}:{response_id}"

    async def put_response(self, tenant: str, response_id: str, info: dict[str, Any], ttl_s: float) -> None:
        await self._redis.set(self._response_key(tenant, response_id), json.dumps(info), ex=max(1, int(ttl_s)))

    async def get_response(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        raw = await self._redis.get(self._response_key(tenant, response_id))
        if not raw:
            return None
        try:
            info = json.loads(raw)
        except ValueError:
            return None
        return info if isinstance(info, dict) else None

    async def reset(self) -> None:
        """Drop every pooled connection (after a failure: they may all lead to a dead server)."""
        await drop_connections(self._redis)

    async def aclose(self) -> None:
        await self._redis.aclose()


def _record(tenant: str, session_id: str, data: dict[str, str]) -> SessionRecord:
    record = SessionRecord(tenant, session_id)
    for name in _INT_FIELDS:
        setattr(record, name, int(data.get(name, 0)))
    record.created = float(data.get("created", 0.0))
    record.last_seen = float(data.get("last_seen", 0.0))
    record.tokens_per_byte = float(data.get("tokens_per_byte", 0.0))
    if data.get("summary"):
        record.summary = json.loads(data["summary"])
    return record
