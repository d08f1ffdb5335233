"""Several proxy processes on one real Redis; Redis really stopped and started under traffic."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import redis

from tests.helpers import ProxyProcess, chat, free_port, steady_window_s
from tests.redis_server import SHARED_URL, PrivateRedis

MODEL = "fake-model"
ADMIN = {"authorization": "Bearer admin-key"}
SYSTEM = {"role": "system", "content": "You are a concise assistant for a hardware store."}


def redis_env(prefix: str, url: str = SHARED_URL, **extra: str) -> dict[str, str]:
    return {
        "PREFIX_PROXY_SESSIONS__STORE": "redis",
        "PREFIX_PROXY_SESSIONS__REDIS_URL": url,
        "PREFIX_PROXY_SESSIONS__KEY_PREFIX": prefix,
        "PREFIX_PROXY_ADMIN_API_KEY": "admin-key",
        **extra,
    }


def test_two_replicas_share_one_session_exactly(
    start_proxies: Callable[..., list[ProxyProcess]], redis_prefix: str
) -> None:
    a, b = start_proxies(2, redis_env(redis_prefix, PREFIX_PROXY_BUDGET__SESSION_TOKENS_PER_WINDOW="3000"))
    history: list[dict[str, Any]] = [SYSTEM]
    sessions, prompt_total, completion_total, statuses = set(), 0, 0, []
    for turn in range(40):
        replica = (a, b)[turn % 2]
        history.append({"role": "user", "content": f"Question {turn}: which screws fit a 6 mm plug?"})
        response = chat(replica.url, history, max_tokens=20)
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert response.json()["error"]["code"] == "session_budget_exceeded"
            assert int(response.headers["retry-after"]) > 0
            history.pop()
            break
        assert response.status_code == 200, response.text
        sessions.add(response.headers["x-prefix-proxy-session"])
        usage = response.json()["usage"]
        prompt_total += usage["prompt_tokens"]
        completion_total += usage["completion_tokens"]
        history.append(response.json()["choices"][0]["message"])
    assert statuses[-1] == 429, "the budget was spent before 40 turns"
    assert len(sessions) == 1
    session_id = sessions.pop()
    for replica in (a, b):
        record = httpx.get(f"{replica.url}/admin/tenants/anonymous/sessions/{session_id}", headers=ADMIN).json()
        assert record["requests"] == statuses.count(200)
        assert record["prompt_tokens"] == prompt_total
        assert record["completion_tokens"] == completion_total
        assert prompt_total + completion_total <= 3000
        assert record["budget_left"]["session"] == 3000 - prompt_total - completion_total


def test_concurrent_requests_stay_within_the_budget(
    start_proxies: Callable[..., list[ProxyProcess]], redis_prefix: str
) -> None:
    limit = 2500
    replicas = start_proxies(2, redis_env(redis_prefix, PREFIX_PROXY_BUDGET__SESSION_TOKENS_PER_WINDOW=str(limit)))
    headers = {"x-session-id": "burst"}

    def one(i: int) -> httpx.Response:
        messages = [SYSTEM, {"role": "user", "content": f"Request {i}: list three kinds of wood glue."}]
        return chat(replicas[i % 2].url, messages, headers=headers, max_tokens=20)

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        responses = list(pool.map(one, range(50)))
    admitted = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    assert len(admitted) + len(rejected) == 50
    assert admitted and rejected
    spent = sum(r.json()["usage"]["total_tokens"] for r in admitted)
    # Documented bound: spend <= limit + sum over in-flight requests of (actual - reserved); every request
    # here reserves max_tokens and an over-estimate of its prompt, so that sum is zero.
    assert spent <= limit
    assert spent >= limit // 3, "admission must not be needlessly strict"
    client = redis.Redis.from_url(SHARED_URL)
    usage_keys = list(client.scan_iter(match=f"{redis_prefix}u:s:*"))
    assert len(usage_keys) == 1
    assert int(client.get(usage_keys[0]) or 0) == spent, "reservations were settled to the real usage"


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_redis_outage_degrades_to_pass_through_and_recovers(
    start_proxies: Callable[..., list[ProxyProcess]], redis_prefix: str
) -> None:
    private = PrivateRedis(free_port()).start()
    try:
        (server,) = start_proxies(
            1, redis_env(redis_prefix, private.url, PREFIX_PROXY_SESSIONS__RETRY_AFTER_FAILURE_S="0.5")
        )
        history: list[dict[str, Any]] = [SYSTEM]
        failures: list[int] = []
        sessions_seen: list[str | None] = []

        def turn(i: int) -> None:
            history.append({"role": "user", "content": f"Turn {i}: what sandpaper grit for pine?"})
            response = chat(server.url, history, max_tokens=20)
            if response.status_code != 200:
                failures.append(response.status_code)
                history.pop()
                return
            sessions_seen.append(response.headers.get("x-prefix-proxy-session"))
            history.append(response.json()["choices"][0]["message"])

        for i in range(5):
            turn(i)
        assert metric(server.url, "prefix_proxy_store_up") == 1
        session_before = sessions_seen[-1]
        assert session_before

        private.stop()
        for i in range(5, 15):
            turn(i)
        assert failures == [], "no request may fail because Redis is down"
        assert metric(server.url, "prefix_proxy_store_up") == 0
        assert metric(server.url, "prefix_proxy_store_errors_total") >= 1
        # The conversation goes on as the session this replica knows (its own copy of it).
        assert sessions_seen[-1] == session_before
        assert metric(server.url, "prefix_proxy_store_fallbacks_total") >= 1

        private.start()
        time.sleep(0.6)
        for i in range(15, 20):
            turn(i)
        assert failures == []
        assert metric(server.url, "prefix_proxy_store_up") == 1
        assert sessions_seen[-1] is not None
        record = httpx.get(f"{server.url}/admin/tenants/anonymous/sessions/{sessions_seen[-1]}", headers=ADMIN)
        assert record.status_code == 200 and record.json()["requests"] >= 1
    finally:
        private.stop()


def test_tenants_provisioned_in_redis(start_proxies: Callable[..., list[ProxyProcess]], redis_prefix: str) -> None:
    client = redis.Redis.from_url(SHARED_URL)
    digest = hashlib.sha256(b"sk-from-redis-42").hexdigest()
    client.set(
        f"{redis_prefix}tenant:{digest}",
        json.dumps({"name": "initech", "budget": {"session_tokens_per_window": 150, "window_s": steady_window_s()}}),
    )
    (server,) = start_proxies(1, redis_env(redis_prefix, PREFIX_PROXY_SESSIONS__TENANTS_IN_REDIS="true"))
    messages = [SYSTEM, {"role": "user", "content": "hello"}]
    assert chat(server.url, messages, max_tokens=20).status_code == 401
    assert chat(server.url, messages, key="sk-wrong", max_tokens=20).status_code == 401
    statuses = []
    for turn in range(6):
        response = chat(server.url, messages, key="sk-from-redis-42", max_tokens=20)
        statuses.append(response.status_code)
        if response.status_code != 200:
            break
        messages = [*messages, response.json()["choices"][0]["message"], {"role": "user", "content": f"more {turn}"}]
    # The tenant's own budget, read from Redis, applies: its 150 tokens per session run out.
    assert statuses[0] == 200 and statuses[-1] == 429
