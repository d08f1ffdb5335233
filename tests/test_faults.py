"""Broken upstreams and a Redis that dies: the proxy answers 502/504 or an error event, at once,
and keeps its books straight. Real HTTP throughout (uvicorn, httpx, a raw-socket upstream in
bench/hostile_upstream.py) and real Redis (a private redis-server, really stopped and started).
"""

from __future__ import annotations

import asyncio
import base64
import json
import resource
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from bench.hostile_upstream import HostileUpstream
from proxy.sessions.model import UsageLimit
from proxy.sessions.redis_store import RedisSessionStore
from tests.helpers import LiveServer, chat, free_port
from tests.redis_server import PrivateRedis

HI = [{"role": "user", "content": "hi"}]  # the hostile upstream answers by model name


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileUpstream]:
    server = HostileUpstream().start()
    yield server
    server.stop()


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def sse_error(response: httpx.Response) -> dict[str, Any]:
    """The error event a stream ended with."""
    events = [line[6:] for line in response.text.split("\n") if line.startswith("data: {")]
    assert events, response.text[:500]
    error = json.loads(events[-1])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


# -- the connection dropped after the request was sent ---------------------------------------------


def test_a_dropped_connection_is_502_and_never_sent_twice(
    make_proxy: Callable[..., LiveServer], hostile: HostileUpstream
) -> None:
    """Two backends: the first reads the request and hangs up. The request may be computing there;
    sending it to the second would do it twice (and it used to be reported as a connect timeout)."""
    second = HostileUpstream().start()
    try:
        proxy = make_proxy(
            upstreams=[hostile.url, second.url],
            routing={"policy": "round_robin", "health_check_interval_s": 0},
        )
        before = hostile.requests["drop"] + second.requests["drop"]
        error = openai_error(chat(proxy, HI, model="drop"), 502)
        assert error["code"] == "upstream_connection_lost"
        assert "timeout" not in error["message"]
        assert hostile.requests["drop"] + second.requests["drop"] == before + 1
    finally:
        second.stop()


def test_a_refused_connection_still_fails_over(make_proxy: Callable[..., LiveServer], hostile: HostileUpstream) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    proxy = make_proxy(upstreams=[dead, hostile.url], routing={"policy": "round_robin", "health_check_interval_s": 0})
    assert all(chat(proxy, HI, model="ok").status_code == 200 for _ in range(4))


# -- streams: unterminated, oversized, malformed ---------------------------------------------------


def test_an_unterminated_event_costs_linear_time_and_is_capped(
    make_proxy: Callable[..., LiveServer], hostile: HostileUpstream
) -> None:
    """An event that never ends: the proxy gives up at max_sse_event_bytes with an error event,
    without rescanning its buffer on every read (that took 33 s of CPU for 40 MB)."""
    proxy = make_proxy(upstream=hostile.url, max_sse_event_bytes=24 * 1024 * 1024)
    cpu_before = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    started = time.monotonic()
    response = chat(proxy, HI, model="unterminated", stream=True)
    elapsed = time.monotonic() - started
    cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu_before
    assert response.status_code == 200
    assert sse_error(response)["code"] == "upstream_event_too_large"
    # Quadratic rescanning of 24 MB in 64 KiB reads is ~4.5 GB of scanning: tens of seconds.
    assert elapsed < 8 and cpu < 8, (elapsed, cpu)


def test_a_client_leaving_mid_event_stops_the_upstream_read(
    make_proxy: Callable[..., LiveServer], hostile: HostileUpstream
) -> None:
    proxy = make_proxy(upstream=hostile.url, max_sse_event_bytes=256 * 1024 * 1024)
    body = {"model": "unterminated", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    hostile.closed_at.pop("unterminated", None)
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
        # While the proxy buffers the endless event, /healthz answers at once.
        started = time.monotonic()
        assert httpx.get(proxy.url + "/healthz", timeout=5).status_code == 200
        assert time.monotonic() - started < 1
    deadline = time.monotonic() + 5
    while "unterminated" not in hostile.closed_at and time.monotonic() < deadline:
        time.sleep(0.05)
    # The upstream stopped being read once the client left, long before the event cap.
    assert "unterminated" in hostile.closed_at, "the proxy kept reading after its client left"
    assert hostile.written["unterminated"] < 128 * 1024 * 1024


def test_malformed_chunks_are_relayed_not_fatal(
    make_proxy: Callable[..., LiveServer], hostile: HostileUpstream
) -> None:
    # A session makes the relay parse every event (it records the reply's text).
    proxy = make_proxy(upstream=hostile.url)
    body = {
        "model": "malformed-chunk",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": "m"}, timeout=30)
    assert response.status_code == 200
    assert '"usage":"x","choices":5' in response.text
    assert response.text.rstrip().endswith("data: [DONE]")


# -- answers that are not what they claim ----------------------------------------------------------


def test_an_html_error_page_is_not_copied_to_the_client(
    make_proxy: Callable[..., LiveServer], hostile: HostileUpstream
) -> None:
    proxy = make_proxy(upstream=hostile.url)
    for stream in (False, True):
        error = openai_error(chat(proxy, HI, model="html-error", stream=stream), 502)
        assert error["message"] == "upstream returned HTTP 502"


def test_a_non_json_answer_is_502_not_application_json(
    make_proxy: Callable[..., LiveServer], hostile: HostileUpstream
) -> None:
    proxy = make_proxy(upstream=hostile.url)
    assert openai_error(chat(proxy, HI, model="not-json"), 502)["code"] == "upstream_invalid_response"


def test_a_json_answer_to_a_stream_request_is_labelled_json(
    make_proxy: Callable[..., LiveServer], hostile: HostileUpstream
) -> None:
    proxy = make_proxy(upstream=hostile.url)
    response = chat(proxy, HI, model="json-for-stream", stream=True)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json()["choices"][0]["message"]["content"] == "fine"


# -- slow drip: the overall deadline ----------------------------------------------------------------


def test_a_slow_drip_ends_at_the_request_deadline(
    make_proxy: Callable[..., LiveServer], hostile: HostileUpstream
) -> None:
    """One byte every 0.3 s never trips the per-read timeout (2 s here); the deadline ends it."""
    proxy = make_proxy(upstream=hostile.url, upstream_timeout_s=2, request_timeout_s=1.5)
    started = time.monotonic()
    error = openai_error(chat(proxy, HI, model="drip"), 504)
    assert error["code"] == "request_deadline_exceeded"
    assert time.monotonic() - started < 4
    started = time.monotonic()
    response = chat(proxy, HI, model="drip", stream=True)
    assert response.status_code == 200
    assert sse_error(response)["code"] == "request_deadline_exceeded"
    assert time.monotonic() - started < 4


# -- credentials in the upstream URL ----------------------------------------------------------------


def test_credentials_in_the_upstream_url_are_sent_as_basic_auth(
    make_proxy: Callable[..., LiveServer], hostile: HostileUpstream
) -> None:
    url = hostile.url.replace("http://", "http://user%40x:p%3Aw@")
    proxy = make_proxy(upstream=url)
    hostile.headers.clear()
    assert chat(proxy, HI, model="ok").status_code == 200
    assert httpx.get(proxy.url + "/readyz").status_code == 200
    expected = "Basic " + base64.b64encode(b"user@x:p:w").decode()
    assert {h.get("authorization") for h in hostile.headers} == {expected}


# -- Redis killed and restarted ----------------------------------------------------------------------


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis(free_port()).start()
    yield server
    server.stop()


async def test_a_restart_between_reserve_and_settle_leaves_no_negative_counter(private_redis: PrivateRedis) -> None:
    store = RedisSessionStore(private_redis.url, prefix="pp:", ttl_s=600)
    limits = [UsageLimit("t:acme", 10_000, "tenant")]
    try:
        reservation = await store.reserve(limits, 800, 3600, time.time())
        private_redis.stop()
        private_redis.start()  # every pooled connection now leads to a dead process
        await store.settle(reservation, -500, 3600)  # used 300 of the 800 reserved
        client = redis.Redis.from_url(private_redis.url)
        assert client.get(reservation.keys[0]) is None, "no counter conjured from a lost reservation"
        # The same after a restart that kept the key but lost its TTL (a replica promoted, say).
        reservation = await store.reserve(limits, 800, 3600, time.time())
        client.persist(reservation.keys[0])
        await store.settle(reservation, -900, 3600)
        assert int(client.get(reservation.keys[0]) or 0) == 0
        assert client.ttl(reservation.keys[0]) > 0
    finally:
        await store.aclose()


def test_redis_killed_between_reserve_and_settle_through_the_proxy(
    make_proxy: Callable[..., LiveServer], private_redis: PrivateRedis
) -> None:
    """A request reserves its budget, Redis dies and comes back while the upstream computes, the
    request settles: the counter is never negative, always expires, and no request fails."""
    proxy = make_proxy(
        sessions={"store": "redis", "redis_url": private_redis.url, "retry_after_failure_s": 0.2},
        budget={"tenant_tokens_per_window": 100_000},
    )
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 50,
        "fake_options": {"delay_s": 1.0},
    }
    result: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: result.append(httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30))
    )
    thread.start()
    time.sleep(0.4)  # reserved, waiting for the upstream
    private_redis.stop()
    private_redis.start()
    thread.join()
    assert result[0].status_code == 200, result[0].text
    time.sleep(0.3)
    client = redis.Redis.from_url(private_redis.url)
    for key in client.scan_iter("*u:*"):
        assert int(client.get(key) or 0) >= 0
        assert client.ttl(key) > 0
    # The reservation died with Redis and the settle must not have re-created it, so there may be no
    # key at all: the pattern above has to find the budget counters when they do exist.
    assert chat(proxy, HI, max_tokens=5).status_code == 200
    assert list(client.scan_iter("*u:*")), "no budget counter matches *u:*: the checks above saw nothing"


def test_no_outages_after_redis_comes_back(make_proxy: Callable[..., LiveServer], private_redis: PrivateRedis) -> None:
    """Stale pooled connections used to fail once each after Redis returned: an outage apiece."""
    proxy = make_proxy(sessions={"store": "redis", "redis_url": private_redis.url, "retry_after_failure_s": 0.3})

    def burst() -> list[httpx.Response]:
        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
                return list(
                    await asyncio.gather(
                        *(client.post(proxy.url + "/v1/chat/completions", json=body) for _ in range(8))
                    )
                )

        return asyncio.run(run())

    assert all(r.status_code == 200 for r in burst())  # fills the pool with several connections
    private_redis.stop()
    private_redis.start()
    time.sleep(0.4)
    errors_before = _metric(proxy, "prefix_proxy_store_errors_total")
    for _ in range(4):
        responses = burst()
        assert all(r.status_code == 200 for r in responses)
        assert all(r.headers.get("x-prefix-proxy-session") for r in responses), "served without sessions"
    assert _metric(proxy, "prefix_proxy_store_errors_total") == errors_before


def _metric(server: LiveServer, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(name)
