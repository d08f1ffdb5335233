"""/v1/messages through the proxy with the real Anthropic SDK, against the fake vLLM backend."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import pytest

from proxy.app import create_app
from proxy.config import Settings
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer

TOOLS: list[Any] = [
    {
        "name": "read_file",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
    {"name": "bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {"cmd": {}}}},
]


def system(date: str) -> list[Any]:
    return [
        {"type": "text", "text": "You are a coding agent. Follow the repository's conventions.\n" * 8},
        {
            "type": "text",
            "text": f"<env>\nWorking directory: /repo\nToday's date: {date}\n</env>",
            "cache_control": {"type": "ephemeral"},
        },
    ]


@pytest.fixture
def client(proxy: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key="anything", max_retries=0)


def last_forwarded(fake_backend: LiveServer) -> dict[str, Any]:
    log = httpx.get(fake_backend.url + "/fake/requests").json()
    return next(r for r in reversed(log) if r["endpoint"] == "/v1/messages")


def run_loop(client: anthropic.Anthropic, date: str, stream: bool) -> list[anthropic.types.Message]:
    """An agent loop: tool calls answered with tool results until the model answers in text."""
    messages: list[Any] = [{"role": "user", "content": "Read the README and summarize it."}]
    replies = []
    for _ in range(3):
        kwargs: dict[str, Any] = {
            "model": "fake-model",
            "max_tokens": 64,
            "system": system(date),
            "tools": TOOLS,
            "messages": messages,
        }
        if stream:
            with client.messages.stream(**kwargs) as events:
                kinds = {event.type for event in events}
                reply = events.get_final_message()
            assert {"message_start", "content_block_start", "message_delta", "message_stop"} <= kinds
        else:
            reply = client.messages.create(**kwargs)
        replies.append(reply)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        calls = [b for b in reply.content if b.type == "tool_use"]
        if not calls:
            break
        messages.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": c.id, "content": "line\n" * 200} for c in calls],
            }
        )
    return replies


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop_hits_the_cache_across_sessions(
    client: anthropic.Anthropic, fake_backend: LiveServer, stream: bool
) -> None:
    run_loop(client, "2025-06-01", stream)
    run_loop(client, "2025-06-02", stream)  # another session, another date: the date is moved
    replies = run_loop(client, "2025-06-03", stream)
    # The long system prompt and the tools are shared across sessions: the first request of the
    # third session reads them from the cache.
    first = replies[0].usage
    assert first.cache_read_input_tokens is not None and first.cache_read_input_tokens >= 160
    # Later turns of the loop extend the previous one.
    assert all((r.usage.cache_read_input_tokens or 0) > first.cache_read_input_tokens for r in replies[1:])
    forwarded = last_forwarded(fake_backend)["body"]
    # The instructions block stays as the client sent it; the environment block moves whole, its
    # tags included (an agent's environment moves from a conversation's first request on).
    assert forwarded["system"] == [system("2025-06-03")[0]]
    env = {"role": "system", "content": "<env>\nWorking directory: /repo\nToday's date: 2025-06-03\n</env>"}
    assert env in forwarded["messages"]


def test_usage_is_the_backends(client: anthropic.Anthropic, fake_backend: LiveServer) -> None:
    reply = client.messages.create(
        model="fake-model", max_tokens=16, messages=[{"role": "user", "content": "Say something short."}]
    )
    record = last_forwarded(fake_backend)
    usage = reply.usage
    assert (
        usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
        == (record["prompt_tokens"])
    )
    assert usage.cache_read_input_tokens == record["cached_tokens"]
    assert usage.output_tokens == record["completion_tokens"]


def test_unchanged_request_is_forwarded_byte_identical(
    proxy: LiveServer, fake_backend: LiveServer, fake_stats: Callable[[], dict[str, Any]]
) -> None:
    raw = (
        b'{"model":"fake-model","max_tokens":8,"system":"Be brief.",'
        b'"messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]}]}'
    )
    response = httpx.post(proxy.url + "/v1/messages", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert response.headers["x-prefix-proxy-prompt-tokens"]
    assert last_forwarded(fake_backend)["body"] == httpx.Response(200, content=raw).json()


def test_count_tokens(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model="fake-model", messages=[{"role": "user", "content": "hello"}])
    assert counted.input_tokens > 0


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [
        ({"model": "fake-model", "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
        ({"model": "fake-model", "max_tokens": 5, "messages": "x"}, 400, "invalid_request_error"),
        ({"model": "fake-model", "max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]}, 400, None),
        ({"model": "fake-model", "max_tokens": 5, "messages": [{"role": "user", "content": [1]}]}, 400, None),
        ({"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 404, None),
    ],
)
def test_errors_in_anthropic_shape(
    proxy: LiveServer, body: dict[str, Any], status: int, error_type: str | None
) -> None:
    response = httpx.post(proxy.url + "/v1/messages", json=body)
    assert response.status_code == status
    payload = response.json()
    assert payload["type"] == "error" and isinstance(payload["error"]["message"], str)
    if error_type:
        assert payload["error"]["type"] == error_type


def test_sdk_raises_typed_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="fake-model", max_tokens=5, messages=[{"role": "robot", "content": "x"}])  # type: ignore[typeddict-item]


def test_non_json_body_is_anthropic_415(proxy: LiveServer) -> None:
    response = httpx.post(proxy.url + "/v1/messages", content=b"hi", headers={"content-type": "text/plain"})
    assert response.status_code == 415
    assert response.json()["type"] == "error"


@pytest.fixture
def keyed_proxy(fake_backend: LiveServer) -> Any:
    settings = Settings(
        upstream=fake_backend.url + "/v1",
        tenants=[{"name": "acme", "api_key": "sk-acme", "upstream_api_key": "up-acme"}],
    )
    server = LiveServer(create_app(settings)).start()
    yield server
    server.stop()


def test_x_api_key_authenticates_and_never_reaches_the_backend(
    keyed_proxy: LiveServer, fake_backend: LiveServer
) -> None:
    body = {"model": "fake-model", "max_tokens": 5, "messages": [{"role": "user", "content": "hello"}]}
    refused = httpx.post(keyed_proxy.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    client = anthropic.Anthropic(base_url=keyed_proxy.url, api_key="sk-acme", max_retries=0)
    assert client.messages.create(**body).content
    headers = last_forwarded(fake_backend)["headers"]
    assert headers.get("authorization") == "Bearer up-acme"
    assert "x-api-key" not in headers
    assert last_forwarded(fake_backend)["body"]["cache_salt"].startswith("pp-")


def test_summary_is_requested_over_messages(make_proxy: Callable[..., LiveServer]) -> None:
    """A long Anthropic conversation is folded, the summary asked for on /v1/messages (rendered as
    the conversation was, so it hits its prefix) and anchored as an inline system message."""
    backend = LiveServer(create_fake_app(FakeBackendConfig(max_model_len=2048))).start()
    try:
        proxy = make_proxy(
            upstream=backend.url + "/v1",
            summarizer={"keep_last_turns": 1},
            budget={"soft_ratio": 0.3},
        )
        client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
        messages: list[Any] = []

        def turn(number: int) -> None:
            messages.append({"role": "user", "content": f"Question {number}: " + "tell me more about caching. " * 20})
            reply = client.messages.create(
                model="fake-model", max_tokens=32, system="You are helpful.", messages=messages,
                extra_headers={"x-session-id": "conv-1"},
            )  # fmt: skip
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})

        def log() -> list[dict[str, Any]]:
            return list(httpx.get(backend.url + "/fake/requests").json())

        number = 0
        deadline = time.monotonic() + 30
        # Compactions run in the background: turns go on until one has been asked for.
        while not any("Write a summary" in str(r["body"]) for r in log()):
            assert time.monotonic() < deadline, "no summary was requested"
            turn(number)
            number += 1
            time.sleep(0.2)
        summaries = [r for r in log() if "Write a summary" in str(r["body"])]
        assert all(r["endpoint"] == "/v1/messages" for r in summaries)
        while any(r["state"] != "completed" for r in summaries):
            assert time.monotonic() < deadline
            time.sleep(0.1)
            summaries = [r for r in log() if "Write a summary" in str(r["body"])]
        assert summaries[0]["cached_tokens"] > 0  # rendered as the conversation was: its prefix hit
        # Stored once the backend answered: the next turns carry it, as a system message.
        while True:
            turn(number)
            number += 1
            last = [r for r in log() if r["endpoint"] == "/v1/messages"][-1]
            if "Summary of the earlier part" in str(last["body"]["messages"]):
                break
            assert time.monotonic() < deadline, "the summary was never anchored"
    finally:
        backend.stop()
