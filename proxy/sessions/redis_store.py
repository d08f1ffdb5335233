"""Redis session store: shared by every proxy replica.

Layout (``p`` = configured key prefix, tenant-namespaced everywhere):
  p s:<tenant>:<sid>       hash   the session record (summary as JSON)
  p fp:<tenant>:<hex>      string session id of one adjacent-message fingerprint
  p idx:<tenant>           zset   session ids by last-seen (listing)
  p active                 zset   "<tenant>\\0<sid>" by last-seen (gauges)
  p u:<scope>:<window>     string tokens used in one budget window
  p lock:<name>            string lock token (SET NX PX)
Every key carries a TTL. Turn recording is one MULTI/EXEC transaction; budget
admission is one Lua script (check every limit, then reserve on all or none).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.sentinel import Sentinel

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
)


def _client(
    url: str, timeout_s: float, sentinels: Sequence[str], service: str, sentinel_password: str | None = None
) -> aioredis.Redis:
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "health_check_interval": 15,
        "decode_responses": True,
    }
    if not sentinels:
        return aioredis.Redis.from_url(url, **options)
    # Sentinel: the sentinels say where the master is, before every new connection and after a
    # failover; the URL still gives the database, credentials and TLS (its host is not used).
    parsed: dict[str, Any] = dict(parse_url(url))
    if "path" in parsed:
        raise ValueError("a unix:// Redis URL cannot be combined with sentinels")
    parsed.pop("host", None)
    parsed.pop("port", None)
    # The sentinel pool brings its own connection class; rediss:// asks it for the TLS variant.
    if parsed.pop("connection_class", None) is SSLConnection:
        parsed["ssl"] = True
    sentinel_options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if sentinel_password:
        sentinel_options["password"] = sentinel_password
    sentinel = Sentinel([_host_port(address) for address in sentinels], sentinel_kwargs=sentinel_options, **options)
    return sentinel.master_for(service, **parsed)


def _host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port``."""
    text = address.strip()
    host, _, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 address needs brackets, or its last group reads as the port
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a sentinel address is host:port or [ipv6]:port, not {address!r}")
    return host, int(port)


class RedisSessionStore:
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
    ) -> None:
        self._redis = _client(url, timeout_s, sentinels, sentinel_service, sentinel_password)
        self._prefix = prefix
        self._ttl = ttl_s
        self._reserve = self._redis.register_script(_RESERVE)
        self._release = self._redis.register_script(_RELEASE)

    @property
    def client(self) -> aioredis.Redis:
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
        raw = await self._redis.mget([self._fp_key(tenant, f) for f in fingerprints])
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
            pipe.hset(
                key,
                mapping={
                    "last_seen": now,
                    "context_tokens": turn.prompt_tokens,
                    "tokens_per_byte": turn.tokens_per_byte,
                },
            )
            pipe.hincrby(key, "requests", 1)
            pipe.hincrby(key, "prompt_tokens", turn.prompt_tokens)
            pipe.hincrby(key, "cached_tokens", turn.cached_tokens)
            pipe.hincrby(key, "completion_tokens", turn.completion_tokens)
            pipe.hincrby(key, "fingerprints", len(turn.new_fingerprints))
            pipe.hset(key, mapping={"last_pair": turn.reply_pair, "last_request_pair": turn.request_pair})
            pipe.expire(key, self._ttl)
            pipe.zadd(f"{self._prefix}idx:{tenant}", {session_id: now})
            pipe.expire(f"{self._prefix}idx:{tenant}", self._ttl)
            pipe.zadd(f"{self._prefix}active", {f"{tenant}\x00{session_id}": now})
            for fingerprint in turn.new_fingerprints:
                pipe.set(self._fp_key(tenant, fingerprint), session_id, ex=self._ttl)
            await pipe.execute()

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
        async with self._redis.pipeline(transaction=True) as pipe:
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
        async with self._redis.pipeline(transaction=True) as pipe:
            for key in reservation.keys:
                pipe.incrby(key, delta)
            await pipe.execute()

    async def usage(self, key: str, window_s: int, now: float) -> int:
        value = await self._redis.get(self.usage_key(key, window_of(now, window_s)[0]))
        return int(value or 0)

    async def acquire_lock(self, name: str, ttl_s: float) -> str | None:
        token = uuid.uuid4().hex
        acquired = await self._redis.set(f"{self._prefix}lock:{name}", token, nx=True, px=int(ttl_s * 1000))
        return token if acquired else None

    async def release_lock(self, name: str, token: str) -> None:
        await self._release(keys=[f"{self._prefix}lock:{name}"], args=[token])

    async def stats(self, since: float) -> tuple[int, int]:
        active_key = f"{self._prefix}active"
        await self._redis.zremrangebyscore(active_key, "-inf", since - self._ttl)
        members = [str(m) for m in await self._redis.zrangebyscore(active_key, since, "+inf", start=0, num=10_000)]
        if not members:
            return 0, 0
        async with self._redis.pipeline(transaction=False) as pipe:
            for member in members:
                tenant, _, session_id = member.partition("\x00")
                pipe.hget(self._session_key(tenant, session_id), "context_tokens")
            values = await pipe.execute()
        return len(members), sum(int(v or 0) for v in values)

    async def tenant_by_digest(self, digest: str) -> str | None:
        """A tenant provisioned in Redis: JSON {name, upstream_api_key?, budget?} under its key's SHA-256."""
        value = await self._redis.get(f"{self._prefix}tenant:{digest}")
        return str(value) if value else None

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
