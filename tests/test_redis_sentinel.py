"""The session store behind Redis Sentinel: a real master, replica and sentinel of our own.

The store finds the master through the sentinel and follows it when the sentinel promotes the
replica; the proxy keeps sessions across that failover.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from proxy.app import create_app
from proxy.config import Settings
from proxy.sessions.model import TurnRecord
from proxy.sessions.redis_store import RedisSessionStore
from tests.helpers import LiveServer, free_port
from tests.redis_server import PrivateRedis, PrivateSentinel


class Cluster:
    def __init__(self, directory: Path) -> None:
        self.master = PrivateRedis(free_port()).start()
        self.replica = PrivateRedis(free_port(), "--replicaof", "127.0.0.1", str(self.master.port)).start()
        self.sentinel = PrivateSentinel(free_port(), directory, self.master.port).start()

    def replicated(self) -> None:
        """Wait until the replica has every write the master took."""
        assert redis.Redis(port=self.master.port).execute_command("WAIT", 1, 5000) == 1

    def fail_over(self) -> None:
        """Stop the master; return once the sentinel names the replica as master."""
        self.master.stop()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if self.sentinel.master_port() == self.replica.port:
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise AssertionError("the sentinel did not promote the replica")

    def stop(self) -> None:
        for server in (self.sentinel, self.replica, self.master):
            server.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path)
    yield cluster
    cluster.stop()


def _turn(prompt: int) -> TurnRecord:
    return TurnRecord(
        prompt_tokens=prompt,
        cached_tokens=0,
        completion_tokens=1,
        tokens_per_byte=0.3,
        new_fingerprints=[],
        reply_pair=0,
        request_pair=0,
    )


def test_store_follows_the_master_across_a_failover(cluster: Cluster) -> None:
    async def scenario() -> None:
        store = RedisSessionStore(
            "redis://127.0.0.1:1/0",  # the host is the sentinel's to say
            prefix="pp:",
            ttl_s=600,
            timeout_s=1.0,
            sentinels=[cluster.sentinel.address],
            sentinel_service=cluster.sentinel.service,
        )
        await store.record_turn("t", "s1", _turn(100), time.time())
        cluster.replicated()
        await asyncio.to_thread(cluster.fail_over)
        deadline = time.monotonic() + 15
        while True:  # the first commands may still meet the old master's dead connections
            try:
                record = await store.get("t", "s1")
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        assert record is not None and record.prompt_tokens == 100 and record.requests == 1
        await store.record_turn("t", "s1", _turn(200), time.time())
        after = await store.get("t", "s1")
        assert after is not None and after.requests == 2 and after.prompt_tokens == 300
        await store.aclose()

    asyncio.run(scenario())


def test_the_proxy_keeps_its_sessions_through_a_sentinel_failover(cluster: Cluster, fake_backend: LiveServer) -> None:
    settings = Settings(
        upstream=fake_backend.url + "/v1",
        sessions={
            "store": "redis",
            "redis_url": "redis://127.0.0.1:1/0",  # nothing there: the master is the sentinel's to say
            "redis_sentinels": cluster.sentinel.address,  # as the environment gives it: a string
            "redis_sentinel_service": cluster.sentinel.service,
            "retry_after_failure_s": 0.2,
            "operation_timeout_s": 1.0,
        },
    )
    assert settings.sessions.redis_sentinels == [cluster.sentinel.address]
    proxy = LiveServer(create_app(settings)).start()
    try:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
        headers = {"x-session-id": "conversation-1"}
        first = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert first.status_code == 200
        session = first.headers["x-prefix-proxy-session"]
        cluster.replicated()
        cluster.fail_over()
        deadline = time.monotonic() + 15
        requests = 0
        while time.monotonic() < deadline and requests < 2:
            response = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
            assert response.status_code == 200  # degraded to pass-through at worst, never an error
            state = httpx.get(proxy.url + f"/v1/sessions/{session}", headers=headers, timeout=10)
            requests = state.json().get("requests", 0) if state.status_code == 200 else 0
            time.sleep(0.3)
        assert requests >= 2, "the session continued on the promoted replica"
    finally:
        proxy.stop()


def test_sentinel_settings_are_checked_and_tls_urls_keep_tls() -> None:
    def store(url: str, *sentinels: str) -> RedisSessionStore:
        return RedisSessionStore(url, prefix="pp:", ttl_s=60, sentinels=sentinels, sentinel_service="m")

    pool = store("rediss://user:secret@ignored:6380/3", "s-0:26379", "[::1]:26379").client.connection_pool
    assert type(pool).__name__ == "SentinelConnectionPool"
    assert pool.connection_class.__name__ == "SentinelManagedSSLConnection"
    assert pool.connection_kwargs["db"] == 3 and pool.connection_kwargs["password"] == "secret"
    for bad in ("fe80::1", "s-0", "s-0:0", "s-0:70000"):
        with pytest.raises(ValueError, match="sentinel address"):
            store("redis://x/0", bad)
    with pytest.raises(ValueError, match="unix"):
        store("unix:///run/redis.sock", "s-0:26379")
