"""Wiring shared memories from settings (``replicas.share_memories``)."""

from __future__ import annotations

from prometheus_client import Counter

from proxy.config import Settings
from proxy.replicas.feed import RedisFeed
from proxy.replicas.memories import Journal, SharedCanonicalizer
from proxy.sessions import RedisClient, RedisSessionStore, configured_client

BLOCK_MS = 1000


def build_shared(
    settings: Settings, store: RedisSessionStore | None, counter: Counter
) -> tuple[SharedCanonicalizer, RedisFeed]:
    if store is None:
        raise ValueError("replicas.share_memories needs the Redis session store (sessions.store: redis)")
    sessions, replicas = settings.sessions, settings.replicas
    journal = Journal()
    canonicalizer = SharedCanonicalizer(settings.canon, journal)

    def client(timeout_s: float) -> RedisClient:
        return configured_client(sessions, timeout_s)

    # Clients of its own: the feed drops its connections after a failure, and doing that to the
    # session store's client would break the store's commands in flight (a burst that timed out
    # one journal write put every request in pass-through on a cluster). A blocking read waits up
    # to BLOCK_MS for news: the reader's socket must outlast it.
    writer = client(sessions.operation_timeout_s)
    reader = client(BLOCK_MS / 1000 + max(1.0, sessions.operation_timeout_s * 4))
    feed = RedisFeed(
        writer,
        reader,
        f"{sessions.key_prefix}canon",
        journal,
        canonicalizer.apply_entries,
        max_entries=replicas.max_entries,
        ttl_s=replicas.ttl_s,
        block_ms=BLOCK_MS,
        warm_entries=replicas.warm_entries,
        retry_after_failure_s=sessions.retry_after_failure_s,
        counter=counter,
    )
    return canonicalizer, feed
