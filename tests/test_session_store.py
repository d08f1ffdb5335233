"""One behaviour suite, run against both session stores: in-memory and a real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from proxy.sessions.memory import MemorySessionStore
from proxy.sessions.model import TurnRecord, UsageLimit
from proxy.sessions.redis_store import RedisSessionStore
from proxy.sessions.store import SessionStore
from tests.redis_server import SHARED_URL, delete_prefix, require_shared_redis, unique_prefix


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        yield MemorySessionStore(ttl_s=3600)
        return
    require_shared_redis()
    prefix = unique_prefix()
    # These tests are about atomicity, not latency: a loaded CI machine must not turn them into
    # socket timeouts (the proxy's own timeout is a setting, tested in test_redis_e2e).
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
    limits = [UsageLimit("t:a", 100, "tenant"), UsageLimit("s:a:1", 50, "session")]
    first = await store.reserve(limits, 40, 60, now)
    assert first.admitted
    second = await store.reserve(limits, 20, 60, now)
    assert not second.admitted and second.rejected_kind == "session" and 0 < second.retry_after_s <= 60
    assert await store.usage("t:a", 60, now) == 40, "a rejected reservation reserves nothing"
    await store.settle(first, -30, 60)
    assert await store.usage("s:a:1", 60, now) == 10
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
