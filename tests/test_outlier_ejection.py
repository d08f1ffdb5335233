"""Outlier detection: a backend that fails fast is ejected, its requests retried elsewhere, and it
rejoins only after a trial request succeeds (docs/routing.md, "Failover and health").

A wedged engine answers every request with 429 or 500 at once while ``GET /v1/models`` answers 200,
so health checks see nothing wrong and, being the least loaded, it draws most of the traffic. Here
it is a real HTTP server beside the vLLM-faithful fake, behind a real proxy, with the openai SDK as
the client (its own retries off: what the client sees is what the proxy did).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.backends import Backend, BackendPool, RoundRobin, backend_name
from proxy.backends.backend import ERRORS, RETRY_AFTER, UNREACHABLE, OutlierDetection
from proxy.backends.upstream import Upstream
from proxy.config import RoutingSettings, Settings
from proxy.http.errors import ProxyError
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import MODEL, LiveServer, free_port

CHAT = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}'


class Misbehaving:
    """A server that answers every POST with ``status`` (and ``headers``) at once while
    ``GET /v1/models`` answers 200, as a wedged engine does. ``status = 200`` heals it (it then
    answers a chat completion); ``every_other_400``: every second POST is answered 400 instead."""

    def __init__(self, status: int, headers: dict[str, str] | None = None, *, every_other_400: bool = False) -> None:
        self.status = status
        self.headers = headers or {}
        self.every_other_400 = every_other_400
        self.answers: Counter[int] = Counter()
        self.server = LiveServer(Starlette(routes=[Route("/v1/models", self._models), self._post_route()])).start()
        self.url = self.server.url + "/v1"
        self.name = backend_name(self.url)

    @property
    def posts(self) -> int:
        return sum(self.answers.values())

    def _post_route(self) -> Route:
        return Route("/v1/{path:path}", self._post, methods=["POST"])

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]})

    async def _post(self, request: Request) -> JSONResponse:
        await request.body()
        status = self.status
        if self.every_other_400 and self.posts % 2 == 1:
            status = 400
        self.answers[status] += 1
        if status == 200:
            return JSONResponse(_completion("healed"))
        error = {"message": f"engine says {status}", "type": "server_error" if status >= 500 else "invalid_request"}
        return JSONResponse({"error": error}, status_code=status, headers=self.headers if status != 400 else {})

    def stop(self) -> None:
        self.server.stop()


def _completion(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-healed",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    }


@pytest.fixture
def good() -> Iterator[LiveServer]:
    server = LiveServer(create_fake_app(FakeBackendConfig())).start()
    yield server
    server.stop()


def _proxy(urls: list[str], **overrides: Any) -> LiveServer:
    if len(urls) == 1:
        return LiveServer(create_app(Settings(upstream=urls[0], **overrides))).start()
    return LiveServer(create_app(Settings(upstreams=urls, **overrides))).start()


def _metric(proxy: LiveServer, name: str, **labels: str) -> float:
    text = httpx.get(proxy.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _requests_seen(server: LiveServer) -> int:
    return int(httpx.get(server.url + "/fake/stats").json()["prefix_cache"]["requests"])


def _burst(proxy: LiveServer, count: int, *, concurrency: int = 4, tag: str = "q") -> list[openai.APIError]:
    """``count`` chat requests (each its own conversation), ``concurrency`` at a time; the errors."""

    async def run() -> list[openai.APIError]:
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        gate = asyncio.Semaphore(concurrency)
        errors: list[openai.APIError] = []

        async def one(i: int) -> None:
            async with gate:
                try:
                    await client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"{tag} {i}: what is {i} + {i}?"}],
                        max_tokens=8,
                    )
                except openai.APIError as error:
                    errors.append(error)

        await asyncio.gather(*(one(i) for i in range(count)))
        await client.close()
        return errors

    return asyncio.run(run())


# -- one good backend beside one answering 429 or 500 to everything --------------------------------


@pytest.mark.parametrize(
    ("status", "headers", "policy", "reason"),
    [
        (429, {"retry-after": "1"}, "affinity", RETRY_AFTER),
        (429, {}, "affinity", ERRORS),
        (500, {}, "affinity", ERRORS),
        (500, {}, "least_in_flight", ERRORS),  # the wedged backend is the least loaded: it drew 92%
    ],
    ids=["429-retry-after", "429", "500", "500-least-in-flight"],
)
def test_a_backend_failing_fast_is_ejected_and_its_requests_retried_on_the_other(
    good: LiveServer, status: int, headers: dict[str, str], policy: str, reason: str
) -> None:
    wedged = Misbehaving(status, headers)
    proxy = _proxy([wedged.url, good.url + "/v1"], routing={"policy": policy})
    try:
        count = 200
        errors = _burst(proxy, count)
        figure = f"{len(errors)} of {count} requests failed; the failing backend drew {wedged.posts} attempts"
        print(f"\n{status} {headers or ''} {policy}: {figure}")
        assert len(errors) <= count // 100, figure  # the bar: at most 1% (0 in every run here)
        assert _requests_seen(good) == count, figure  # every request was answered by the good backend
        # Ejected: after a few failures (and the requests in flight at that moment) only trials.
        assert 1 <= wedged.posts <= 20, figure
        assert _metric(proxy, "prefix_proxy_backend_ejections_total", backend=wedged.name, reason=reason) >= 1
        # Every attempt it failed went on to the other backend before the client saw anything.
        assert _metric(proxy, "prefix_proxy_backend_failovers_total", backend=wedged.name) == wedged.posts
        outcome = "http_429" if status == 429 else "http_5xx"
        assert _metric(proxy, "prefix_proxy_backend_requests_total", backend=wedged.name, outcome=outcome) == (
            wedged.posts
        )
    finally:
        proxy.stop()
        wedged.stop()


def test_a_400_is_relayed_not_retried_and_does_not_hide_a_run_of_500s(good: LiveServer) -> None:
    """A wedged vLLM still validates requests in its API server: its 400s are the requests' fault
    (relayed as they are, never retried) and say nothing of its health, so the 500s around them
    still add up to an ejection."""
    wedged = Misbehaving(500, every_other_400=True)  # 500, 400, 500, 400, 500, ...
    proxy = _proxy([wedged.url, good.url + "/v1"], routing={"policy": "round_robin"})
    try:
        statuses: Counter[int] = Counter()
        bodies: list[str] = []
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            for i in range(12):  # well within its 1 s ejection: no trial here
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 8}
                response = client.post("/v1/chat/completions", json=body)
                statuses[response.status_code] += 1
                if response.status_code == 400:
                    bodies.append(response.json()["error"]["message"])
        assert wedged.answers[500] == 3 and wedged.answers[400] == 2, wedged.answers
        # Each 400 reached the client as the backend wrote it, and went nowhere else.
        assert statuses == {200: 10, 400: 2}, statuses
        assert bodies == ["engine says 400"] * 2
        assert _requests_seen(good) == 10
        assert _metric(proxy, "prefix_proxy_backend_failovers_total", backend=wedged.name) == 3
        # 500, 400, 500, 400, 500: three failures in a row as far as its health goes.
        assert _metric(proxy, "prefix_proxy_backend_ejections_total", backend=wedged.name, reason=ERRORS) == 1
        assert _metric(proxy, "prefix_proxy_backend_up", backend=wedged.name) == 0
    finally:
        proxy.stop()
        wedged.stop()


@pytest.mark.parametrize(("status", "headers"), [(429, {"retry-after": "5"}), (500, {})], ids=["429", "500"])
def test_with_one_backend_its_429_or_500_is_relayed_as_is(status: int, headers: dict[str, str]) -> None:
    wedged = Misbehaving(status, headers)
    proxy = _proxy([wedged.url])
    try:
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            for i in range(5):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}]}
                response = client.post("/v1/chat/completions", json=body)
                assert response.status_code == status
                assert response.json()["error"]["message"] == f"engine says {status}"
                # The backend's Retry-After reaches the client, whose retry should wait as asked.
                assert response.headers.get("retry-after") == headers.get("retry-after")
        assert wedged.posts == 5  # nothing retried: there is nowhere else to go
        outcome = "http_429" if status == 429 else "http_5xx"
        assert _metric(proxy, "prefix_proxy_backend_requests_total", outcome=outcome) == 5
        assert _metric(proxy, "prefix_proxy_backend_ejections_total") == 0
        assert _metric(proxy, "prefix_proxy_backend_up") == 1  # never ejected: it is all there is
    finally:
        proxy.stop()
        wedged.stop()


def test_when_every_backend_fails_the_client_gets_the_last_answer_and_one_stays_in_service() -> None:
    limited, broken = Misbehaving(429, {"retry-after": "30"}), Misbehaving(500)
    proxy = _proxy([limited.url, broken.url], routing={"policy": "round_robin"})
    try:
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            first = client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
            # Tried on both before the client saw anything; the last one's answer is the client's.
            assert limited.posts == 1 and broken.posts == 1
            assert first.status_code == 500 and first.json()["error"]["message"] == "engine says 500"
            for _ in range(5):
                response = client.post(
                    "/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"}
                )
                assert response.status_code == 500
        # The 429 asked for 30 s off; the other one, the last in service, is never ejected.
        assert _metric(proxy, "prefix_proxy_backend_ejections_total", backend=limited.name, reason=RETRY_AFTER) == 1
        assert _metric(proxy, "prefix_proxy_backend_ejections_total", backend=broken.name) == 0
        assert _metric(proxy, "prefix_proxy_backend_up", backend=broken.name) == 1
        assert limited.posts == 1 and broken.posts == 6
    finally:
        proxy.stop()
        limited.stop()
        broken.stop()


def test_an_ejected_backend_rejoins_only_after_its_trial_succeeds(good: LiveServer) -> None:
    """Health checks (every 0.1 s here) see ``/v1/models`` answer 200 throughout: they must not
    re-admit it. Each end of an ejection lets one trial request through (retried on the good
    backend when it fails, longer ejection next); once the backend heals, its trial succeeds and it
    takes its share again."""
    wedged = Misbehaving(500)
    proxy = _proxy(
        [wedged.url, good.url + "/v1"], routing={"policy": "least_in_flight", "health_check_interval_s": 0.1}
    )
    try:
        assert not _burst(proxy, 40, tag="warm-up")
        ejected = _metric(proxy, "prefix_proxy_backend_ejections_total", backend=wedged.name, reason=ERRORS)
        assert ejected >= 1
        ejected_after = wedged.posts
        # Wedged for 2.5 s of steady traffic: health checks pass, ejections end, trials fail.
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            assert not _burst(proxy, 8, tag="wedged")
        trials = wedged.posts - ejected_after
        assert 1 <= trials <= 2, trials  # one trial per ejection (1 s, then 2 s): no stampede
        # Each failed trial ejected it again, for longer.
        assert (
            _metric(proxy, "prefix_proxy_backend_ejections_total", backend=wedged.name, reason=ERRORS)
            == ejected + trials
        )
        wedged.status = 200  # the engine recovers
        deadline = time.monotonic() + 10
        while not wedged.answers[200] and time.monotonic() < deadline:
            assert not _burst(proxy, 8, tag="healing")
        assert wedged.answers[200] >= 1, "the healed backend was never given a trial"
        assert _metric(proxy, "prefix_proxy_backend_up", backend=wedged.name) == 1
        before = wedged.answers[200]
        assert not _burst(proxy, 40, tag="healed")
        assert wedged.answers[200] - before >= 10  # back in service: about its share of 40
    finally:
        proxy.stop()
        wedged.stop()


# -- the pool itself: ejection rules, health checks, settings ---------------------------------------


def test_health_checks_readmit_an_unreachable_backend_but_not_one_ejected_for_its_answers(good: LiveServer) -> None:
    wedged = Misbehaving(500)
    port = free_port()

    async def scenario() -> None:
        backends = [
            Backend("wedged", Upstream(wedged.url)),
            Backend("dead", Upstream(f"http://127.0.0.1:{port}/v1")),
            Backend("good", Upstream(good.url + "/v1")),
        ]
        pool = BackendPool(
            backends, RoundRobin(), outliers=OutlierDetection(consecutive_failures=1, base_ejection_s=30)
        )
        wedged_b, dead, live = backends
        response = await pool.open("POST", "/chat/completions", content=CHAT)
        await pool.read(response)
        # wedged: 500 (ejected, retried) -> dead: unreachable (ejected) -> good: 200.
        assert response.status_code == 200 and response.extensions["prefix_proxy_backend"] == "good"
        assert (wedged_b.ejected_for, dead.ejected_for) == (ERRORS, UNREACHABLE)
        assert not wedged_b.available() and not dead.available() and live.available()
        revived = LiveServer(create_fake_app(FakeBackendConfig()), port=port).start()
        try:
            await pool.check_health(timeout_s=1.0, hold_s=30.0)
            assert dead.available() and dead.ejected_for is None  # the check reached it: back
            assert not wedged_b.available() and wedged_b.ejected_for == ERRORS  # lists models, still out
        finally:
            revived.stop()
        await pool.aclose()

    try:
        asyncio.run(scenario())
    finally:
        wedged.stop()


def test_retry_after_ejects_at_once_for_as_long_as_it_asks_capped(good: LiveServer) -> None:
    asks = Misbehaving(429, {"retry-after": "20"})
    greedy = Misbehaving(503, {"retry-after": "3600"})

    async def ejection(server: Misbehaving, replayable: bool = True) -> tuple[int, float, str | None]:
        backends = [Backend("wedged", Upstream(server.url)), Backend("good", Upstream(good.url + "/v1"))]
        pool = BackendPool(backends, RoundRobin(), outliers=OutlierDetection(max_retry_after_s=45))
        response = await pool.open("POST", "/chat/completions", content=CHAT, replayable=replayable)
        await pool.read(response)
        await pool.aclose()
        return response.status_code, backends[0].ejected_until - time.monotonic(), backends[0].ejected_for

    try:
        status, left, reason = asyncio.run(ejection(asks))
        assert status == 200 and reason == RETRY_AFTER and 19 < left <= 20
        status, left, reason = asyncio.run(ejection(greedy))
        assert status == 200 and reason == RETRY_AFTER and 44 < left <= 45
        # A body that can be sent once is not retried: the answer is the client's.
        status, left, reason = asyncio.run(ejection(asks, replayable=False))
        assert status == 429 and reason == RETRY_AFTER
    finally:
        asks.stop()
        greedy.stop()


def test_a_trial_that_times_out_or_is_cancelled_never_leaves_the_backend_stuck() -> None:
    calls = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise httpx.ReadTimeout("still computing", request=request)
        await asyncio.sleep(10)  # the second trial: the client leaves while it waits
        return httpx.Response(200, json={})

    async def scenario() -> None:
        transport = httpx.MockTransport(handler)
        slow = Backend("slow:1", Upstream("http://slow:1/v1", transport=transport))
        other = Backend("other:1", Upstream("http://other:1/v1"))
        pool = BackendPool([slow, other], RoundRobin(), outliers=OutlierDetection(base_ejection_s=0.05))
        slow.eject(ERRORS, time.monotonic(), 0.0)  # its ejection is over: the next request is its trial
        with pytest.raises(ProxyError) as timed_out:
            await pool.open("POST", "/chat/completions", content=CHAT, pinned_to="slow:1")
        assert timed_out.value.status == 504
        assert not slow.on_trial and slow.ejected_for == ERRORS and slow.ejections == 2  # out again, longer
        await asyncio.sleep(0.15)
        assert slow.available()
        task = asyncio.create_task(pool.open("POST", "/chat/completions", content=CHAT, pinned_to="slow:1"))
        await asyncio.sleep(0.05)
        assert slow.on_trial and not slow.available()  # no other request while its trial runs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not slow.on_trial and slow.in_flight == 0 and slow.available()  # the next one is the trial
        await pool.aclose()

    asyncio.run(scenario())


def test_one_failure_in_flight_per_request_does_not_escalate_an_ejection() -> None:
    backend = Backend("a:1", Upstream("http://a:1/v1"), outliers=OutlierDetection())
    now = time.monotonic()
    assert not backend.failed(trial=False, at_once=False)
    assert not backend.failed(trial=False, at_once=False)
    assert backend.failed(trial=False, at_once=False)  # the third in a row
    assert backend.eject(ERRORS, now) == 1.0
    # The requests it had in flight come back failing too: counted, not ejected again.
    assert not backend.failed(trial=False, at_once=True) and backend.ejections == 1
    assert backend.start_trial(now + 1.0) and not backend.start_trial(now + 1.0)  # one trial at a time
    assert not backend.available(now + 1.0)
    assert backend.failed(trial=True, at_once=False) and backend.eject(ERRORS, now + 1.0) == 2.0
    backend.record_success(now + 3.0)
    assert backend.available(now + 3.0) and backend.consecutive_failures == 0 and backend.ejected_for is None


def test_the_ejection_schedule_and_retry_after() -> None:
    rules = OutlierDetection(base_ejection_s=1.0, max_ejection_s=30.0, max_retry_after_s=60.0)
    assert [rules.ejection_s(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert rules.ejection_s(10_000) == 30.0  # no overflow however many
    now = time.time()
    assert rules.retry_after_s("5") == 5.0 and rules.retry_after_s(" 1.5 ") == 1.5
    assert rules.retry_after_s("600") == 60.0  # capped
    in_ten = email.utils.formatdate(now + 10, usegmt=True)
    assert 8.0 < (rules.retry_after_s(in_ten, now) or 0) <= 11.0
    assert rules.retry_after_s(email.utils.formatdate(now - 10, usegmt=True), now) is None  # past
    for unreadable in (None, "", "0", "-3", "soon", "nan", "1e9", "Fri, 99 Foo 2026"):
        assert rules.retry_after_s(unreadable) is None, unreadable
    assert OutlierDetection(max_retry_after_s=0).retry_after_s("5") is None  # not honoured


def test_settings_defaults_are_the_pools_and_reach_it() -> None:
    assert OutlierDetection.from_settings(RoutingSettings()) == OutlierDetection()
    routing = RoutingSettings(
        consecutive_failures=5, base_ejection_s=2, max_ejection_s=300, max_retry_after_s=10, max_retries=1
    )
    rules = OutlierDetection.from_settings(routing)
    assert rules == OutlierDetection(5, 2.0, 300.0, 10.0, 1)
    backends = [Backend(name, Upstream(f"http://{name}/v1")) for name in ("a:1", "b:1")]
    pool = BackendPool(backends, RoundRobin(), outliers=rules)
    assert pool.outliers is rules and all(b.outliers is rules for b in backends)
    with pytest.raises(ValueError):
        RoutingSettings(consecutive_failures=0)


class Poisoned(Misbehaving):
    """A healthy engine that answers 500 to one input (a request that trips a bug in it)."""

    async def _post(self, request: Request) -> JSONResponse:
        body = await request.body()
        status = 500 if b"poison" in body else 200
        self.answers[status] += 1
        if status == 200:
            return JSONResponse(_completion("fine"))
        return JSONResponse({"error": {"message": "engine says 500", "type": "server_error"}}, status_code=500)


def test_a_request_that_fails_on_every_backend_ejects_none() -> None:
    """A tenant sending an input that makes every engine fail must not take healthy backends out of
    rotation for everyone: a failure counts against a backend only once another answered the request."""
    backends = [Poisoned(200), Poisoned(200), Poisoned(200)]
    proxy = _proxy([b.url for b in backends])
    poison = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "poison"}]})
    try:
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            for _ in range(10):
                response = client.post(
                    "/v1/chat/completions", content=poison, headers={"content-type": "application/json"}
                )
                assert response.status_code == 500
            fine = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
            assert (
                client.post(
                    "/v1/chat/completions", content=fine, headers={"content-type": "application/json"}
                ).status_code
                == 200
            )
        assert _metric(proxy, "prefix_proxy_backend_ejections_total") == 0
        assert _metric(proxy, "prefix_proxy_backend_up") == 3
    finally:
        proxy.stop()
        for backend in backends:
            backend.stop()
