"""One JSON line per request, without prompt text unless asked for; x-request-id end to end."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import httpx
import pytest

from proxy.observability.access_log import JsonFormatter
from tests.helpers import LiveServer

SECRET = "my password is hunter2"


def send(server: LiveServer) -> httpx.Response:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 5}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers={"x-request-id": "req-abc-123"})


def test_one_json_line_per_request_without_prompt_text(proxy: LiveServer, access_lines: list[str]) -> None:
    response = send(proxy)
    assert response.headers["x-request-id"] == "req-abc-123"
    (line,) = [json.loads(x) for x in access_lines if "req-abc-123" in x]
    assert line["route"] == "chat" and line["status"] == 200 and line["model"] == "fake-model"
    assert line["tenant"] == "anonymous" and line["prompt_tokens"] > 0 and "cached_tokens" in line
    assert isinstance(line["actions"], list) and line["overhead_ms"] >= 0
    assert SECRET not in "".join(access_lines)


def test_request_id_reaches_the_upstream(proxy: LiveServer, fake_backend: LiveServer) -> None:
    send(proxy)
    logged = httpx.get(fake_backend.url + "/fake/requests", params={"limit": 5}).json()
    assert any(r["headers"].get("x-request-id") == "req-abc-123" for r in logged)


def test_prompts_logged_only_when_enabled(make_proxy: Callable[..., LiveServer], access_lines: list[str]) -> None:
    send(make_proxy(log_prompts=True))
    assert SECRET in "".join(access_lines)


def test_timestamps_are_utc_whatever_the_local_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        record = logging.LogRecord("prefix_proxy.access", logging.INFO, __file__, 1, "request", None, None)
        record.created, record.msecs = 86_400.25, 250.0
        assert json.loads(JsonFormatter().format(record))["ts"] == "1970-01-02T00:00:00.250Z"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
