"""Connecting to Redis: one server, a Sentinel-watched master, or a Redis Cluster.

Every caller (the session store, the replicas' shared memory feed) gets its client here, so the
three topologies are configured in one place and behave alike: short timeouts, and one immediate
retry on a fresh connection when a pooled one turns out dead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from proxy.config import SessionSettings, sentinel_address

# Pooled connections per server at most. redis-py 8 caps a pool at 100 by default and fails the
# 101st concurrent command at once (MaxConnectionsError), which the proxy would take for an outage:
# every request in pass-through for retry_after_failure_s because of a burst. A cluster client
# goes further and closes every connection it holds (see redis_client).
MAX_CONNECTIONS = 10_000

# What every topology's client answers to (the commands the proxy uses exist on both).
RedisClient = aioredis.Redis | RedisCluster


def configured_client(sessions: SessionSettings, timeout_s: float) -> RedisClient:
    """:func:`redis_client` for the store ``sessions`` configures (what the session store and the
    replicas' shared memories connect to)."""
    password = sessions.redis_sentinel_password
    return redis_client(
        sessions.redis_url,
        timeout_s,
        sentinels=sessions.redis_sentinels,
        service=sessions.redis_sentinel_service,
        sentinel_password=password.get_secret_value() if password else None,
        cluster=sessions.redis_cluster,
    )


def client_problem(sessions: SessionSettings) -> str | None:
    """Why the client ``sessions`` configures could not be made (redis-py's own reason), without
    opening a connection: the client as ``serve`` makes it, and one of its connections made, not
    opened, which reads the URL's options (a Redis Cluster's database, a protocol version)."""
    try:
        client = configured_client(sessions, 1.0)
        pool = getattr(client, "connection_pool", None)
        if pool is not None and not sessions.redis_sentinels:
            pool.make_connection()
    except Exception as error:  # whatever redis-py raises (RedisClusterException is no RedisError)
        return str(error).rstrip(".") or type(error).__name__
    return None


def redis_client(
    url: str,
    timeout_s: float,
    *,
    sentinels: Sequence[str] = (),
    service: str = "mymaster",
    sentinel_password: str | None = None,
    cluster: bool = False,
) -> RedisClient:
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "health_check_interval": 15,
        "decode_responses": True,
        # A pooled connection to a Redis that restarted fails on first use ("closed by server"):
        # one immediate retry on a new connection instead of an outage per stale connection.
        "retry": Retry(NoBackoff(), 1),
        "max_connections": MAX_CONNECTIONS,
    }
    if cluster:
        if sentinels:
            raise ValueError("redis_cluster and redis_sentinels exclude each other")
        # Any node is a seed: the client asks it for the slot map and follows MOVED / ASK
        # redirections (a slot moving, a replica promoted) by itself. A connection error on a node
        # makes it re-read the map before its retry, which is how a failover is followed.
        # Its pool per node is capped too, and going over the cap counts as a connection error, on
        # which the client closes every connection it holds, those of the commands in flight
        # included: a burst of requests must never reach the cap.
        return _Cluster.from_url(url, **options)
    options["retry_on_error"] = [RedisConnectionError]
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
    sentinel = Sentinel([host_port(address) for address in sentinels], sentinel_kwargs=sentinel_options, **options)
    return sentinel.master_for(service, **parsed)


class _Cluster(RedisCluster):
    """redis-py's cluster client, started by one command at a time.

    A burst of commands on a client that has not read the slot map yet (at start, or after a
    failure dropped its connections) can fail in redis-py 8 while the first connections are being
    set up ("Connection closed by server", a connection without a writer): tested with 100 budget
    admissions at once, a third of the bursts failed. The first command after (re)initialization
    runs alone; the others wait for it, then go together.
    """

    _start_lock: asyncio.Lock | None = None

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            if self._start_lock is None:
                self._start_lock = asyncio.Lock()
            async with self._start_lock:
                if self._initialize:
                    return await super().execute_command(*args, **kwargs)
        return await super().execute_command(*args, **kwargs)


# ``host:port`` or ``[ipv6]:port``: the parse that settings check as they load.
host_port = sentinel_address


async def drop_connections(client: RedisClient) -> None:
    """Forget every pooled connection (after a failure they may all lead to a dead server); the next
    command opens fresh ones (and, on a cluster, re-reads the slot map first)."""
    if isinstance(client, RedisCluster):
        await client.aclose()
    else:
        await client.connection_pool.disconnect()
