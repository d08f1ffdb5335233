"""Miss explanation end to end: header, counters and access log through the proxy and the fake backend."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.config import Settings
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer, chat, stream_chat

SESSION: dict[str, Any] = {"max_tokens": 30, "headers": {"x-session-id": "conv-1"}}
SYSTEM = "You are the booking assistant.\nNow: 2024-05-01 10:00:00\n" + "Be precise and friendly. " * 30


@pytest.fixture
def servers() -> Iterator[tuple[LiveServer, LiveServer]]:
    backend = LiveServer(create_fake_app(FakeBackendConfig())).start()
    settings = Settings(upstream=backend.url + "/v1")
    settings = settings.model_copy(update={"canon": settings.canon.model_copy(update={"mode": "off"})})
    proxy = LiveServer(create_app(settings)).start()
    yield backend, proxy
    proxy.stop()
    backend.stop()


def counter(proxy: LiveServer, cause: str, name: str = "prefix_proxy_cache_breaks_total") -> float:
    text = httpx.get(proxy.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(f'{name}{{cause="{cause}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} series for {cause}")


def test_causes_reach_header_counter_and_access_log(
    servers: tuple[LiveServer, LiveServer], access_lines: list[str]
) -> None:
    backend, proxy = servers
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Book a room."},
    ]
    response = chat(proxy, messages, **SESSION)
    reply = response.json()["choices"][0]["message"]
    assert response.headers["x-prefix-proxy-cache-break"].startswith("new_conversation; message=0; tokens=")

    # Appending a turn (streamed) costs nothing: the reply the backend generated is cached too.
    messages += [reply, {"role": "user", "content": "For two nights."}]
    response, text = stream_chat(proxy, messages, **SESSION)
    reply = {"role": "assistant", "content": text}
    assert response.headers["x-prefix-proxy-cache-break"] == "none"
    messages += [reply, {"role": "user", "content": "With breakfast."}]
    response = chat(proxy, messages, **SESSION)
    reply = response.json()["choices"][0]["message"]
    assert response.headers["x-prefix-proxy-cache-break"] == "none"
    assert int(response.headers["x-prefix-proxy-cached-tokens"]) > 0

    # A Dify-style timestamp in the system prompt moves on: line 2 of message 0.
    messages[0] = {"role": "system", "content": SYSTEM.replace("10:00:00", "10:00:09")}
    messages += [reply, {"role": "user", "content": "And parking."}]
    response = chat(proxy, messages, **SESSION)
    reply = response.json()["choices"][0]["message"]
    header = response.headers["x-prefix-proxy-cache-break"]
    assert header.startswith("system_changed; message=0; line=2; tokens=")
    lost = int(header.rsplit("=", 1)[1])
    prompt_tokens = int(response.headers["x-prefix-proxy-prompt-tokens"])
    assert 0.8 * prompt_tokens < lost <= prompt_tokens  # almost the whole previous prompt
    assert counter(proxy, "system_changed") == 1
    assert counter(proxy, "system_changed", "prefix_proxy_cache_break_tokens_total") == lost

    # The backend loses its cache (a restart, a too-small KV pool): the proxy expected a hit.
    assert httpx.post(backend.url + "/fake/reset").status_code == 200
    messages += [reply, {"role": "user", "content": "Thanks."}]
    response = chat(proxy, messages, **SESSION)
    header = response.headers["x-prefix-proxy-cache-break"]
    assert header.startswith("cache_evicted; tokens=") and int(header.rsplit("=", 1)[1]) > 100
    assert counter(proxy, "cache_evicted") == 1

    logged = [json.loads(line) for line in access_lines]
    causes = [line["cache_break"]["cause"] for line in logged if "cache_break" in line]
    assert causes == ["new_conversation", "none", "none", "system_changed", "cache_evicted"]
    assert not any("booking assistant" in line for line in access_lines)


def test_messages_and_responses_are_explained_too(servers: tuple[LiveServer, LiveServer]) -> None:
    """/v1/messages and /v1/responses: explained on their chat-shaped view, header and all."""
    _, proxy = servers
    headers = {"x-session-id": "anthropic-1"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Book a room for two nights, please."}]
    body = {"model": "fake-model", "max_tokens": 30, "system": SYSTEM}
    first = httpx.post(proxy.url + "/v1/messages", json={**body, "messages": messages}, headers=headers)
    assert first.status_code == 200, first.text
    assert first.headers["x-prefix-proxy-cache-break"].startswith("new_conversation; message=0; tokens=")
    text = "".join(block.get("text", "") for block in first.json()["content"])
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "With breakfast."}]
    second = httpx.post(proxy.url + "/v1/messages", json={**body, "messages": messages}, headers=headers)
    assert second.status_code == 200, second.text
    assert second.headers["x-prefix-proxy-cache-break"] == "none"

    items: list[dict[str, Any]] = [{"role": "user", "content": "Book a table for four."}]
    request = {"model": "fake-model", "instructions": SYSTEM, "max_output_tokens": 30, "store": False}
    first = httpx.post(proxy.url + "/v1/responses", json={**request, "input": items})
    assert first.status_code == 200, first.text
    # The same system prompt as the Messages conversation (same tenant and model): it is cached.
    assert first.headers["x-prefix-proxy-cache-break"].startswith("new_conversation; message=1; tokens=")
    text = "".join(
        part.get("text", "")
        for item in first.json()["output"]
        if item.get("type") == "message"
        for part in item.get("content", [])
    )
    items += [{"role": "assistant", "content": text}, {"role": "user", "content": "At eight."}]
    second = httpx.post(proxy.url + "/v1/responses", json={**request, "input": items})
    assert second.status_code == 200, second.text
    assert second.headers["x-prefix-proxy-cache-break"] == "none"
