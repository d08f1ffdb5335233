"""Hostile clients: malformed requests get a 400 naming the parameter (never a 500 or a
traceback), /metrics cannot be broken or read by them, and tenants learn nothing of each other
from it. Real servers (uvicorn) and real Redis, as everywhere else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.config import Settings
from proxy.observability.metrics import Metrics
from proxy.sessions.model import TurnRecord
from proxy.tenants import REDIS_CACHE_MAX_UNKNOWN_KEYS, TenantDirectory, key_digest
from tests.helpers import LiveServer, free_port
from tests.redis_server import PrivateRedis

MODEL = "fake-model"
USER = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# -- malformed requests: 400 with the parameter, no traceback -------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [*USER, {"role": "assistant", "tool_calls": True}]}, "messages[1].tool_calls"),
        (
            {"model": MODEL, "messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "a", "function": "f"}]}]},
            "messages[1].tool_calls[0].function",
        ),
        ({"model": MODEL, "messages": [*USER, {"role": "assistant", "tool_calls": [7]}]}, "messages[1].tool_calls[0]"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [1, 2]}]}, "messages[0].content[0]"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
        ({"model": MODEL, "messages": USER, "tools": [5]}, "tools[0]"),
        ({"model": MODEL, "messages": USER, "tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
        (
            {"model": MODEL, "messages": USER, "tools": [{"function": {"name": "f", "parameters": 3}}]},
            "tools[0].function.parameters",
        ),
        ({"model": MODEL, "messages": USER, "tool_choice": 5}, "tool_choice"),
        ({"model": MODEL, "messages": USER, "max_tokens": "ten"}, "max_tokens"),
        ({"model": MODEL, "messages": USER, "max_tokens": [5]}, "max_tokens"),
        ({"model": "m" * 1000, "messages": USER}, "model"),
    ],
)
def test_wrong_types_are_400_naming_the_parameter(
    proxy: LiveServer, caplog: pytest.LogCaptureFixture, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
    assert openai_error(response, 400)["param"] == param
    no_tracebacks(caplog)


@pytest.mark.parametrize(
    "raw",
    [
        # Nested ~990 deep anywhere: past orjson's limit, the stdlib fallback raised RecursionError.
        '{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "x": ' + nested(990) + "}",
        # tools[].function.parameters 300 deep: orjson cannot serialize it (RecursionError later).
        '{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
        '"function": {"name": "f", "parameters": {"a": ' + nested(300) + "}}}]}",
    ],
)
def test_deep_nesting_is_400(proxy: LiveServer, caplog: pytest.LogCaptureFixture, raw: str) -> None:
    response = httpx.post(proxy.url + "/v1/chat/completions", content=raw.encode(), headers=JSON, timeout=30)
    assert "nests deeper" in openai_error(response, 400)["message"]
    no_tracebacks(caplog)


@pytest.mark.parametrize("route", ["chat/completions", "completions", "embeddings"])
def test_a_lone_surrogate_model_is_400_and_metrics_keep_working(
    proxy: LiveServer, caplog: pytest.LogCaptureFixture, route: str
) -> None:
    raw = (
        b'{"model": "\\ud800", "prompt": "hi", "input": "hi", "max_tokens": 2, '
        b'"messages": [{"role": "user", "content": "hi"}]}'
    )
    response = httpx.post(f"{proxy.url}/v1/{route}", content=raw, headers=JSON, timeout=30)
    assert openai_error(response, 400)["param"] == "model"
    assert httpx.get(proxy.url + "/metrics").status_code == 200
    no_tracebacks(caplog)


def test_label_values_can_always_be_exposed() -> None:
    """Whatever becomes a label value (a tenant name from a Redis record, say), the exposition works."""
    metrics = Metrics(tenants=["t\ud800x"])
    metrics.record_request("chat", 200, "m", "t\ud800x")
    metrics.confirm_model("m\udfff" + "y" * 500)
    metrics.record_request("chat", 200, "m\udfff" + "y" * 500, "anonymous")
    text = metrics.exposition().decode()
    assert 'tenant="t\\\\ud800x"' in text
    assert re.search(r'model="m\\\\udfffy{100,}"', text)


def test_non_json_bodies_are_415(proxy: LiveServer) -> None:
    """What a web page can make a browser send cross-site without a CORS preflight."""
    body = json.dumps({"model": MODEL, "messages": USER}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"content-type": content_type} if content_type else {}
        response = httpx.post(proxy.url + "/v1/chat/completions", content=body, headers=headers)
        assert openai_error(response, 415)["code"] == "unsupported_media_type"
    ok = httpx.post(
        proxy.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json; charset=utf-8"}
    )
    assert ok.status_code == 200


def test_a_client_leaving_mid_upload_logs_no_traceback(proxy: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="prefix_proxy")
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100000\r\n\r\n" + b'{"model": "fake-model", '
        )
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(
        getattr(r, "fields", {}).get("status") == 499 for r in caplog.records
    ):
        time.sleep(0.05)
    assert any(getattr(r, "fields", {}).get("error") == "client_disconnected" for r in caplog.records)
    no_tracebacks(caplog)


@pytest.mark.parametrize("query", ["abc", "0", "-1", "1.5", "", "%00", "99999999999999999999999"])
def test_bad_limits_are_400_in_openai_shape(make_proxy: Callable[..., LiveServer], query: str) -> None:
    server = make_proxy(admin_api_key="admin")
    if query == "99999999999999999999999":  # huge is fine: capped
        assert httpx.get(f"{server.url}/v1/sessions?limit={query}").status_code == 200
        return
    assert openai_error(httpx.get(f"{server.url}/v1/sessions?limit={query}"), 400)["param"] == "limit"
    admin = httpx.get(
        f"{server.url}/admin/tenants/anonymous/sessions?limit={query}", headers={"authorization": "Bearer admin"}
    )
    assert openai_error(admin, 400)["param"] == "limit"


def test_limit_is_capped_at_1000(fake_backend: LiveServer) -> None:
    app = create_app(Settings(upstream=fake_backend.url + "/v1"))
    store = app.state.proxy.sessions.store
    now = time.time()

    async def fill() -> None:
        for i in range(1005):
            await store.record_turn("anonymous", f"s{i}", TurnRecord(1, 0, 1, 0.25, [], 0, 0), now)

    asyncio.run(fill())
    server = LiveServer(app).start()
    try:
        assert len(httpx.get(server.url + "/v1/sessions?limit=5000").json()["data"]) == 1000
        assert len(httpx.get(server.url + "/v1/sessions?limit=3").json()["data"]) == 3
        assert len(httpx.get(server.url + "/v1/sessions").json()["data"]) == 100
    finally:
        server.stop()


# -- /metrics: nothing one tenant can learn about another, and a door of its own -------------------

TENANTS = [{"name": "acme", "api_key": "sk-acme"}, {"name": "globex", "api_key": "sk-globex"}]
SYSTEM = "You are the assistant of Project Nightingale, launching 3 May. Keep it confidential. " * 5


def metric_value(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_prefix_reuse_is_counted_per_tenant(make_proxy: Callable[..., LiveServer]) -> None:
    """B guesses A's system prompt and watches reuse="repeat": it must not move."""
    server = make_proxy(tenants=TENANTS)

    def send(key: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, *USER], "max_tokens": 2}
        response = httpx.post(
            server.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
        assert response.status_code == 200

    def repeats() -> float:
        return metric_value(
            httpx.get(server.url + "/metrics").text, "prefix_proxy_prefix_requests_total", 'reuse="repeat"'
        )

    send("sk-acme")
    before = repeats()
    send("sk-globex")
    assert repeats() == before
    send("sk-globex")
    assert repeats() == before + 1  # its own prompt, seen before: that is its own business


def test_model_names_become_labels_only_once_served(proxy: LiveServer) -> None:
    """A label made from any name a client sends would let one tenant ask whether another sent it."""
    body = {"model": "project-nightingale-ft", "messages": USER}
    assert httpx.post(proxy.url + "/v1/chat/completions", json=body).status_code == 404
    assert httpx.post(proxy.url + "/v1/chat/completions", json={**body, "model": MODEL}).status_code == 200
    text = httpx.get(proxy.url + "/metrics").text
    assert "project-nightingale-ft" not in text
    assert f'model="{MODEL}"' in text


def test_metrics_key(make_proxy: Callable[..., LiveServer]) -> None:
    server = make_proxy(metrics_api_key="scrape-me")
    assert openai_error(httpx.get(server.url + "/metrics"), 401)["code"] == "invalid_api_key"
    assert openai_error(httpx.get(server.url + "/metrics", headers={"authorization": "Bearer nope"}), 401)
    response = httpx.get(server.url + "/metrics", headers={"authorization": "Bearer scrape-me"})
    assert response.status_code == 200 and "prefix_proxy_requests_total" in response.text


def test_metrics_on_their_own_port(fake_backend: LiveServer) -> None:
    """``prefix-proxy serve`` with metrics_port: /metrics there only; SIGTERM stops both servers."""
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PREFIX_PROXY_METRICS_PORT": str(metrics_port), "PREFIX_PROXY_METRICS_API_KEY": "k"}
    command = [sys.executable, "-m", "proxy", "serve", "--upstream", fake_backend.url + "/v1", "--port", str(port)]
    process = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1)
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "proxy did not start"
                time.sleep(0.1)
        assert openai_error(httpx.get(f"http://127.0.0.1:{port}/metrics"), 404)
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").status_code == 401
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", headers={"authorization": "Bearer k"})
        assert scraped.status_code == 200 and "prefix_proxy_requests_total" in scraped.text
        process.terminate()  # both servers drain; a drain that finished exits 0 (proxy.serve)
        assert process.wait(timeout=15) == 0
    finally:
        process.kill()


# -- tenants in Redis ---------------------------------------------------------------------------------


async def test_unknown_keys_are_remembered_boundedly() -> None:
    lookups: list[str] = []

    async def lookup(digest: str) -> str | None:
        lookups.append(digest)
        return json.dumps({"name": "initech"}) if digest == key_digest("sk-good") else None

    directory = TenantDirectory([], lookup)
    for i in range(REDIS_CACHE_MAX_UNKNOWN_KEYS + 500):
        with pytest.raises(Exception, match="invalid or missing API key"):
            await directory.authenticate(f"Bearer sk-random-{i}")
    assert len(directory._unknown) <= REDIS_CACHE_MAX_UNKNOWN_KEYS
    assert (await directory.authenticate("Bearer sk-good")).name == "initech"
    calls = len(lookups)
    await directory.authenticate("Bearer sk-good")  # remembered: no second lookup
    assert len(lookups) == calls


async def test_random_keys_cannot_flush_a_known_tenant_before_an_outage() -> None:
    """A tenant's key seen once is kept while any number of unknown keys go by, so with Redis down
    it is still let in (not the 503 an unknown key gets)."""
    redis_up = True

    async def lookup(digest: str) -> str | None:
        if not redis_up:
            raise ConnectionError("redis down")
        return json.dumps({"name": "initech"}) if digest == key_digest("sk-good") else None

    directory = TenantDirectory([], lookup)
    assert (await directory.authenticate("Bearer sk-good")).name == "initech"
    for i in range(REDIS_CACHE_MAX_UNKNOWN_KEYS + 500):
        with pytest.raises(Exception, match="invalid or missing API key"):
            await directory.authenticate(f"Bearer sk-random-{i}")
    redis_up = False
    directory._cache[key_digest("sk-good")] = (directory._cache[key_digest("sk-good")][0], 0.0)  # stale
    assert (await directory.authenticate("Bearer sk-good")).name == "initech"
    with pytest.raises(Exception, match="cannot be checked"):
        await directory.authenticate("Bearer sk-never-seen")


async def test_a_malformed_tenant_record_is_refused_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    records = [
        "not json",
        json.dumps({"nom": "x"}),
        json.dumps({"name": 5}),
        json.dumps({"name": "x", "budget": 7}),
        json.dumps(["name"]),
    ]
    for record in records:

        async def lookup(digest: str, record: str = record) -> str | None:
            return record

        with pytest.raises(Exception, match="invalid or missing API key") as raised:
            await TenantDirectory([], lookup).authenticate("Bearer sk-x")
        assert getattr(raised.value, "status", None) == 401
    assert sum("malformed tenant record" in r.getMessage() for r in caplog.records) == len(records)


def test_redis_down_gives_503_for_unknown_keys_and_keeps_known_tenants(
    make_proxy: Callable[..., LiveServer], caplog: pytest.LogCaptureFixture
) -> None:
    private = PrivateRedis(free_port()).start()
    try:
        import redis

        redis.Redis.from_url(private.url).set(f"pp:tenant:{key_digest('sk-initech')}", json.dumps({"name": "initech"}))
        server = make_proxy(
            sessions={"store": "redis", "redis_url": private.url, "key_prefix": "pp:", "tenants_in_redis": True}
        )
        body = {"model": MODEL, "messages": USER, "max_tokens": 2}
        known = {"authorization": "Bearer sk-initech"}
        assert httpx.post(server.url + "/v1/chat/completions", json=body, headers=known).status_code == 200
        private.stop()
        for key in ("sk-unknown", "sk-another"):
            response = httpx.post(
                server.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            assert openai_error(response, 503)["code"] == "store_unavailable"
            assert response.headers["retry-after"]
        assert openai_error(httpx.get(server.url + "/v1/sessions", headers={"authorization": "Bearer sk-x"}), 503)
        assert httpx.post(server.url + "/v1/chat/completions", json=body, headers=known).status_code == 200
        assert openai_error(httpx.post(server.url + "/v1/chat/completions", json=body), 401)
        no_tracebacks(caplog)
    finally:
        private.stop()


@pytest.mark.parametrize("lines", [3, 120_001])
def test_a_system_prompt_of_more_lines_than_the_text_memory_holds_is_served(
    make_proxy: Callable[..., Any], fake_backend: Any, caplog: pytest.LogCaptureFixture, lines: int
) -> None:
    """A text larger than the whole text memory (``canon.text_memory_lines``: 100,000 by default,
    or 1 as configured here) is read, not kept: before, cachetools refused it ("value too large")
    and the request was a 500. The engine's own answer is the client's (the long one is past the
    fake engine's context: its 400)."""
    proxy = make_proxy(canon={"text_memory_lines": 1} if lines == 3 else {})
    system = "".join(f"Rule {n}: be brief.\n" for n in range(lines))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    body = {"model": "fake-model", "messages": messages}
    direct = httpx.post(fake_backend.url + "/v1/chat/completions", json=body, timeout=60).status_code
    for _ in range(2):  # the second time, a text seen before is kept
        response = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == direct, response.text
    no_tracebacks(caplog)
