"""One behaviour suite, run against every session store: in-memory, a real Redis, a real Redis Cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.crc import key_slot

from proxy.chat.budget import usage_limits
from proxy.config import BudgetSettings
from proxy.sessions.memory import MemorySessionStore
from proxy.sessions.model import TurnRecord, UsageLimit
from proxy.sessions.redis_store import RedisSessionStore
from proxy.sessions.store import SessionStore
from tests.redis_server import SHARED_URL, PrivateCluster, delete_prefix, require_shared_redis, unique_prefix


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[PrivateCluster]:
    """A real 3-master Redis Cluster of the module's own (no replicas: failover is tested elsewhere)."""
    cluster = PrivateCluster(masters=3).start()
    yield cluster
    cluster.stop()


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        yield MemorySessionStore(ttl_s=3600)
        return
    prefix = unique_prefix()
    # These tests are about atomicity, not latency: a loaded CI machine must not turn them into
    # socket timeouts (the proxy's own timeout is a setting, tested in test_redis_e2e).
    if request.param == "redis-cluster":
        cluster: PrivateCluster = request.getfixturevalue("redis_cluster")
        cluster_store = RedisSessionStore(cluster.url, prefix=prefix, ttl_s=3600, timeout_s=5.0, cluster=True)
        yield cluster_store
        await cluster_store.aclose()
        return
    require_shared_redis()
    redis_store = RedisSessionStore(SHARED_URL, prefix=prefix, ttl_s=3600, timeout_s=5.0)
    yield redis_store
    await redis_store.aclose()
    delete_prefix(SHARED_URL, prefix)


def turn(prompt: int, fingerprints: list[int] | None = None) -> TurnRecord:
    return TurnRecord(prompt, prompt // 2, 10, 0.3, fingerprints or [])


async def test_turns_add_up(store: SessionStore) -> None:
    now = time.time()
    await store.record_turn("t", "s1", turn(100, [1, 2]), now)
    await store.record_turn("t", "s1", turn(200, [3]), now + 1)
    record = await store.get("t", "s1")
    assert record is not None
    assert (record.requests, record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (2, 300, 150, 20)
    assert record.context_tokens == 200
    assert record.fingerprints == 3
    assert record.tokens_per_byte == pytest.approx(0.3)
    assert record.created == pytest.approx(now)
    assert record.last_seen == pytest.approx(now + 1)


async def test_pair_hashes_keep_all_64_bits(store: SessionStore) -> None:
    pairs = (2**64 - 1, 2**63, 12345)
    await store.record_turn("t", "s1", TurnRecord(1, 0, 1, 0.25, [2**64 - 2], *pairs), time.time())
    record = await store.get("t", "s1")
    assert record is not None
    assert (record.last_pair, record.last_request_pair, record.first_pair) == pairs


async def test_fingerprint_lookup_is_tenant_scoped(store: SessionStore) -> None:
    await store.record_turn("alice", "s1", turn(10, [11, 12]), time.time())
    matches, _ = await store.lookup("alice", [12, 99])
    assert matches == ["s1", None]
    other, _ = await store.lookup("bob", [11, 12])
    assert other == [None, None]
    assert await store.get("bob", "s1") is None


async def test_list_and_delete(store: SessionStore) -> None:
    now = time.time()
    await store.record_turn("t", "old", turn(1), now)
    await store.record_turn("t", "new", turn(1), now + 5)
    await store.record_turn("other", "x", turn(1), now)
    assert [r.session_id for r in await store.list_sessions("t")] == ["new", "old"]
    assert await store.delete("t", "old")
    assert not await store.delete("t", "old")
    assert not await store.delete("t", "x"), "another tenant's session cannot be deleted"
    assert [r.session_id for r in await store.list_sessions("t")] == ["new"]


async def test_summary_round_trip(store: SessionStore) -> None:
    await store.record_turn("t", "s", turn(1), time.time())
    await store.set_summary("t", "s", {"text": "résumé", "covered": [1, 2], "tokens": 12})
    record = await store.get("t", "s")
    assert record is not None and record.summary == {"text": "résumé", "covered": [1, 2], "tokens": 12}
    await store.set_summary("t", "s", None)
    record = await store.get("t", "s")
    assert record is not None and record.summary is None


async def test_reservations_are_all_or_nothing(store: SessionStore) -> None:
    now = time.time()
    limits = [UsageLimit("t:{a}", 100, "tenant"), UsageLimit("s:{a}:1", 50, "session")]
    first = await store.reserve(limits, 40, 60, now)
    assert first.admitted
    second = await store.reserve(limits, 20, 60, now)
    assert not second.admitted and second.rejected_kind == "session" and 0 < second.retry_after_s <= 60
    assert await store.usage("t:{a}", 60, now) == 40, "a rejected reservation reserves nothing"
    await store.settle(first, -30, 60)
    assert await store.usage("s:{a}:1", 60, now) == 10
    assert (await store.reserve(limits, 20, 60, now)).admitted


async def test_concurrent_reservations_never_pass_the_limit(store: SessionStore) -> None:
    now = time.time()
    limits = [UsageLimit("s:c", 1000, "session")]
    results = await asyncio.gather(*(store.reserve(limits, 30, 60, now) for _ in range(100)))
    admitted = sum(r.admitted for r in results)
    assert admitted == 33
    assert await store.usage("s:c", 60, now) == 990


async def test_lock_is_exclusive_and_expires(store: SessionStore) -> None:
    token = await store.acquire_lock("compact:t:s", 0.3)
    assert token is not None
    assert await store.acquire_lock("compact:t:s", 0.3) is None
    await store.release_lock("compact:t:s", "not-the-token")
    assert await store.acquire_lock("compact:t:s", 0.3) is None
    await asyncio.sleep(0.4)
    assert await store.acquire_lock("compact:t:s", 0.3) is not None


async def test_stats_count_active_sessions(store: SessionStore) -> None:
    now = time.time()
    await store.record_turn("t", "a", turn(100), now)
    await store.record_turn("u", "b", turn(50), now)
    active, tokens = await store.stats(now - 10)
    assert active >= 2 and tokens >= 150


@pytest.mark.parametrize("tenant", ["acme", "we{ird}", "}x{", ""])
def test_the_budget_keys_of_one_admission_share_a_cluster_slot(tenant: str) -> None:
    budget = BudgetSettings(tenant_tokens_per_window=100, session_tokens_per_window=50)
    keys = [f"prefix-proxy:u:{limit.key}:123" for limit in usage_limits(budget, tenant, "0123abcd")]
    assert len(keys) == 2
    assert key_slot(keys[0].encode()) == key_slot(keys[1].encode())


async def test_admission_with_the_proxys_own_budget_keys(store: SessionStore) -> None:
    """What proxy.chat.budget builds is what the store must admit atomically (one slot on a cluster)."""
    now = time.time()
    budget = BudgetSettings(tenant_tokens_per_window=100, session_tokens_per_window=60)
    limits = usage_limits(budget, "acme", "s1")
    assert (await store.reserve(limits, 50, 60, now)).admitted
    rejected = await store.reserve(limits, 20, 60, now)
    assert not rejected.admitted and rejected.rejected_kind == "session"
    other_session = usage_limits(budget, "acme", "s2")
    assert (await store.reserve(other_session, 50, 60, now)).admitted
    assert not (await store.reserve(other_session, 1, 60, now)).admitted, "the tenant's 100 are spent"
    assert await store.usage(limits[0].key, 60, now) == 100


async def test_what_an_unreserved_request_spent_is_charged_against_every_limit(store: SessionStore) -> None:
    """A request admitted while the store was down is charged once it answers again: later
    admissions see those tokens spent."""
    now = time.time()
    budget = BudgetSettings(tenant_tokens_per_window=100, session_tokens_per_window=60)
    limits = usage_limits(budget, "initech", "s9")
    await store.charge(limits, 45, 60, now)
    assert await store.usage(limits[0].key, 60, now) == 45
    assert await store.usage(limits[1].key, 60, now) == 45
    assert not (await store.reserve(limits, 20, 60, now)).admitted  # 45 + 20 > the session's 60
    assert (await store.reserve(limits, 15, 60, now)).admitted


async def test_bursts_on_a_fresh_client_and_after_a_reset_all_succeed(store: SessionStore) -> None:
    """The first commands of a client (at start, after a failure dropped its connections) may come
    all at once: on a cluster, redis-py 8 failed a third of such bursts until the first command ran
    alone (proxy/sessions/connect.py)."""
    now = time.time()
    for key in ("s:{t}:burst-1", "s:{t}:burst-2"):
        limits = [UsageLimit(key, 1000, "session")]
        results = await asyncio.gather(*(store.reserve(limits, 30, 60, now) for _ in range(300)))
        assert sum(r.admitted for r in results) == 33
        await store.reset()


async def test_memory_stats_read_only_the_active_sessions() -> None:
    store = MemorySessionStore(ttl_s=3600)
    now = time.time()
    await store.record_turn("t", "old", turn(10), now - 100)
    await store.record_turn("t", "idle", turn(20), now - 50)
    await store.record_turn("t", "new", turn(30), now)
    assert await store.stats(now - 10) == (1, 30)
    await store.record_turn("t", "old", turn(40), now + 1)  # touched again: active again
    assert await store.stats(now - 10) == (2, 70)
    assert await store.stats(now - 60) == (3, 90)
