"""Issue 47, points 2 and 3: readiness that keeps a fleet up, and an upstream that refuses the proxy's
key reported as such.

A session store outage leaves every replica ready (200, "degraded" in /readyz's body, in the
start-up line and in prefix_proxy_readiness) while it serves without sessions; only
``readiness.require_store`` makes it 503. An upstream that answers 401/403 to the proxy's own
credentials is ``auth_failed`` at start-up and in /readyz (not ready), and clients get a 502
``upstream_auth_failed``, not the upstream's 401 as if their key were wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.app import create_app
from proxy.config import ReadinessSettings, Settings
from proxy.reload import reload_settings
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer, chat, chat_ok
from tests.redis_server import SHARED_URL
from tests.test_operator_config import REDIS_DOWN, Served

HI = [{"role": "user", "content": "hi"}]
VLLM_KEY = "vllm-key-0123456789"


def readiness_metric(server: LiveServer) -> dict[str, float]:
    """prefix_proxy_readiness's value for each state, as /metrics exposes it."""
    values = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("prefix_proxy_readiness{"):
            state = line.split('state="', 1)[1].split('"', 1)[0]
            values[state] = float(line.rsplit(" ", 1)[1])
    return values


# -- the session store ----------------------------------------------------------------------------------


def test_a_store_outage_leaves_every_replica_ready_and_serving(make_proxy: Callable[..., LiveServer]) -> None:
    replicas = [make_proxy(sessions={"store": "redis", "redis_url": REDIS_DOWN}) for _ in range(2)]
    for replica in replicas:
        ready = httpx.get(replica.url + "/readyz")
        assert ready.status_code == 200
        body = ready.json()
        assert body["status"] == "degraded" and body["store"] == {"kind": "redis", "status": "down"}
        assert body["degraded"] == ["the session store is down: serving without sessions"]
        assert "reasons" not in body
        assert readiness_metric(replica) == {"ready": 0, "degraded": 1, "not_ready": 0}
        # Degrade, never fail: requests are served meanwhile (without sessions).
        chat_ok(replica, HI, max_tokens=3)


def test_a_setting_makes_a_store_outage_take_the_replica_out(make_proxy: Callable[..., LiveServer]) -> None:
    proxy = make_proxy(sessions={"store": "redis", "redis_url": REDIS_DOWN}, readiness={"require_store": True})
    ready = httpx.get(proxy.url + "/readyz")
    assert ready.status_code == 503
    assert ready.json()["status"] == "not ready" and ready.json()["reasons"] == ["the session store is down"]
    assert readiness_metric(proxy) == {"ready": 0, "degraded": 0, "not_ready": 1}
    # The setting it replaced still says the same, the other way round.
    legacy = make_proxy(sessions={"store": "redis", "redis_url": REDIS_DOWN, "ready_when_store_down": False})
    assert httpx.get(legacy.url + "/readyz").status_code == 503


def test_what_readiness_requires_changes_on_reload(fake_backend: LiveServer) -> None:
    """SIGHUP applies readiness.require_store (proxy.reload): the next /readyz answers by it."""
    settings = Settings(upstream=fake_backend.url + "/v1", sessions={"store": "redis", "redis_url": REDIS_DOWN})
    app = create_app(settings)
    with LiveServer(app) as proxy:
        assert httpx.get(proxy.url + "/readyz").status_code == 200
        strict = settings.model_copy(update={"readiness": ReadinessSettings(require_store=True)})
        assert reload_settings(app.state.proxy, lambda: strict) == ["readiness"]
        assert httpx.get(proxy.url + "/readyz").status_code == 503


def test_a_store_that_answers_is_ready(make_proxy: Callable[..., LiveServer], redis_prefix: str) -> None:
    proxy = make_proxy(
        sessions={"store": "redis", "redis_url": SHARED_URL, "key_prefix": redis_prefix},
        readiness={"require_store": True},
    )
    ready = httpx.get(proxy.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert ready.json()["store"] == {"kind": "redis", "status": "up"}
    assert readiness_metric(proxy) == {"ready": 1, "degraded": 0, "not_ready": 0}


def test_the_start_up_line_says_degraded(fake_backend: Any) -> None:
    served = Served(
        ["--upstream", fake_backend.url + "/v1"],
        {"PREFIX_PROXY_SESSIONS__STORE": "redis", "PREFIX_PROXY_SESSIONS__REDIS_URL": REDIS_DOWN},
    )
    try:
        started = served.logged(lambda r: r.get("event") == "started")
        assert started["ready"] is True and started["readiness"] == "degraded"
        warning = served.logged(lambda r: "session store redis" in r.get("message", ""))
        assert warning["message"].endswith("the replica stays ready, degraded (readiness.require_store: false)")
    finally:
        served.stop()


# -- an upstream that refuses the proxy's key ------------------------------------------------------------


def requiring_key(app: ASGIApp, key: str) -> ASGIApp:
    """``app`` behind vLLM's ``--api-key``: its /v1 routes answer 401 without ``Bearer key``."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        guarded_path = scope["type"] == "http" and scope["path"].startswith("/v1")
        if guarded_path and dict(scope["headers"]).get(b"authorization") != f"Bearer {key}".encode():
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await app(scope, receive, send)

    return guarded


@pytest.fixture(scope="module")
def keyed_backend() -> Iterator[LiveServer]:
    server = LiveServer(requiring_key(create_fake_app(FakeBackendConfig()), VLLM_KEY)).start()
    yield server
    server.stop()


def test_an_upstream_that_refuses_the_proxys_key_is_auth_failed(keyed_backend: LiveServer) -> None:
    url = keyed_backend.url + "/v1"
    served = Served(["--upstream", url])  # vLLM started with --api-key; upstream_api_key not set
    try:
        started = served.logged(lambda r: r.get("event") == "started")
        (upstream,) = started["upstreams"]
        assert upstream["status"] == "auth_failed" and started["ready"] is False
        assert upstream["detail"] == (
            f"GET {url}/models answered 401 to no key (upstream_api_key is not set): set upstream_api_key to the "
            "key the upstream expects (vLLM: its --api-key)"
        )
        warning = served.logged(lambda r: r.get("level") == "warning" and "auth_failed" in r.get("message", ""))
        assert url in warning["message"]
        ready = httpx.get(served.url + "/readyz")
        assert ready.status_code == 503
        assert ready.json()["reasons"] == ["the upstream refuses the proxy's credentials"]
        assert list(ready.json()["backends"].values()) == ["auth_failed"]
        # A client, whatever key it holds, is told whose credentials were refused: a server error.
        for stream in (False, True):
            response = chat(served.url, HI, key="anything", max_tokens=3, stream=stream)
            assert response.status_code == 502, response.text
            error = response.json()["error"]
            assert error["code"] == "upstream_auth_failed" and error["type"] == "upstream_error"
            assert error["message"].startswith(
                "the upstream refused the proxy's credentials (the client's key, passed on: upstream_api_key is not "
                "set; HTTP 401)"
            )
            assert "anything" not in response.text
    finally:
        served.stop()


def test_a_wrong_upstream_key_is_auth_failed_and_the_right_one_up(
    keyed_backend: LiveServer, make_proxy: Callable[..., LiveServer]
) -> None:
    wrong = make_proxy(upstream=keyed_backend.url + "/v1", upstream_api_key="not-the-key")
    ready = httpx.get(wrong.url + "/readyz")
    assert ready.status_code == 503 and list(ready.json()["backends"].values()) == ["auth_failed"]
    refused = chat(wrong, HI, max_tokens=3)
    assert refused.status_code == 502 and "its upstream_api_key; HTTP 401" in refused.json()["error"]["message"]
    assert "not-the-key" not in refused.text

    right = make_proxy(upstream=keyed_backend.url + "/v1", upstream_api_key=VLLM_KEY)
    ready = httpx.get(right.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    chat_ok(right, HI, max_tokens=3)


def test_tenants_with_their_own_upstream_keys_do_not_need_the_proxys(
    keyed_backend: LiveServer, make_proxy: Callable[..., LiveServer]
) -> None:
    """Every request goes up with its tenant's key: the proxy's own (none) being refused is expected."""
    proxy = make_proxy(
        upstream=keyed_backend.url + "/v1",
        tenants=[{"name": "acme", "api_key": "pp-acme", "upstream_api_key": VLLM_KEY}],
    )
    ready = httpx.get(proxy.url + "/readyz")
    assert ready.status_code == 200 and list(ready.json()["backends"].values()) == ["up"]
    chat_ok(proxy, HI, key="pp-acme", max_tokens=3)
