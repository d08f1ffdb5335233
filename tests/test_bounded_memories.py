"""What the proxy keeps as traffic grows on the axes other than one conversation's length (a review
of many conversations, tenants and tool calls): each memory within its bound, and no per-request
step that passes over every session or tenant. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from typing import Any

import redis

from proxy.openai import canonical_arguments, jsonio
from proxy.openai.jsoncanon import _canonical_argument_string
from proxy.sessions import MemorySessionStore, RedisSessionStore
from proxy.sessions.model import TurnRecord
from tests.redis_server import SHARED_URL


def test_shared_tool_json_stays_within_its_byte_bound() -> None:
    """orjson's bytes hold its 4 KiB writing buffer however short they are: 20,000 tool-less
    requests' "[]" kept 86 MB against a 16 MiB bound."""
    jsonio._SHARED.clear()
    lists = [[] for _ in range(20_000)]  # held, as a request holds its body while it is served
    tracemalloc.start()
    for value in lists:
        jsonio.shared_json(value)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    jsonio._SHARED.clear()
    assert used <= 2 * jsonio.SHARED_BYTES, used


def test_tool_call_arguments_are_kept_within_a_byte_bound() -> None:
    """An agent writing files sends argument strings of tens of kilobytes: 65,536 entries of them were
    kept whatever their size (2 GB at 16 KB each)."""
    _canonical_argument_string.cache_clear()
    tracemalloc.start()
    for number in range(4000):
        canonical_arguments(json.dumps({"path": f"/f{number}", "content": "x" * 16_000}))
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    _canonical_argument_string.cache_clear()
    assert used < 48 * 2**20, used
    # Still a memo: the same string is read once.
    arguments = json.dumps({"b": 1, "a": 2})
    assert canonical_arguments(arguments) is canonical_arguments(arguments)


def test_listing_a_quiet_tenant_does_not_pass_over_every_session() -> None:
    """The operator page lists each tenant's newest sessions: with 200 tenants and 40,000 sessions of
    one of them it took 2.3 s of the event loop."""

    async def cost(sessions: int) -> float:
        store = MemorySessionStore(ttl_s=3600, max_sessions=200_000)
        for number in range(sessions):
            await store.set_summary("busy", f"s{number}", None)
        await store.set_summary("quiet", "only", None)
        started = time.perf_counter()
        for _ in range(20):
            listed = await store.list_sessions("quiet", 20)
        assert [record.session_id for record in listed] == ["only"]
        return time.perf_counter() - started

    assert asyncio.run(cost(100_000)) < 10 * asyncio.run(cost(1_000)) + 0.01


def test_a_tenants_session_index_forgets_expired_sessions(redis_prefix: str) -> None:
    """Redis: idx:<tenant> took every session ever seen while the tenant kept sending (131 bytes each,
    forever); the sessions it lists live ttl_s after their last turn."""

    async def run() -> int:
        store = RedisSessionStore(SHARED_URL, prefix=redis_prefix, ttl_s=1)
        for number in range(100):
            await store.record_turn("t", f"s{number}", TurnRecord(10, 0, 1, 4.0), time.time())
        for number in range(6):  # the tenant keeps sending: its index never expires as a whole
            await asyncio.sleep(0.3)
            await store.record_turn("t", f"k{number % 3}", TurnRecord(10, 0, 1, 4.0), time.time())
        held = int(redis.Redis.from_url(SHARED_URL).zcard(f"{redis_prefix}idx:t"))  # before a listing cleans
        listed = await store.list_sessions("t", 100)
        assert {record.session_id for record in listed} == {"k0", "k1", "k2"}
        return held

    assert asyncio.run(run()) <= 3


def test_the_active_sessions_gauge_counts_past_its_sample(redis_prefix: str, monkeypatch: Any) -> None:
    """Redis: the gauges' refresh read every active session (10,000 HGETs in one burst) and stopped
    counting there; it counts them all and reads the context of a sample."""
    from proxy.sessions import redis_store

    monkeypatch.setattr(redis_store, "STATS_SAMPLE", 10)

    async def run() -> tuple[int, int]:
        store = RedisSessionStore(SHARED_URL, prefix=redis_prefix, ttl_s=600)
        now = time.time()
        for number in range(40):
            await store.record_turn("t", f"s{number}", TurnRecord(100, 0, 0, 4.0), now)
        return await store.stats(now - 60)

    active, context = asyncio.run(run())
    assert active == 40
    assert context == 40 * 100
