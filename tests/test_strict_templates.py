"""A backend whose chat template refuses a system message after the first (Mistral, Gemma).

Relocation inserts one before the last user turn; such a backend answers 400. The proxy
then resends the request with the client's message order (volatile lines appended to the
system prompt instead) and keeps doing so for that model. Nothing reaches the client but
the answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from summarizer.anchor import SUMMARY_HEADER
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer, chat

SYSTEM = "Current time: 2026-11-29 14:03:11\nYou are a support assistant. Answer briefly and politely."


@pytest.fixture(scope="module")
def strict_backend() -> Iterator[LiveServer]:
    server = LiveServer(create_fake_app(FakeBackendConfig(system_anywhere=False))).start()
    yield server
    server.stop()


def asking(system: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def seen_varying(proxy: LiveServer) -> None:
    """One earlier request with another time: the proxy moves a span only once its place has varied."""
    response = chat(proxy, asking(SYSTEM.replace("14:03:11", "13:59:02"), "Hello"), max_tokens=8)
    assert response.status_code == 200
    assert "volatile_moved" not in response.headers.get("x-prefix-proxy-actions", "")


def test_the_strict_backend_refuses_an_inserted_system_message(strict_backend: LiveServer) -> None:
    messages = [
        {"role": "system", "content": "stable"},
        {"role": "system", "content": "moved"},
        {"role": "user", "content": "hi"},
    ]
    body = {"model": "fake-model", "messages": messages}
    response = httpx.post(strict_backend.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "roles must alternate" in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_rewrite_is_resent_in_the_client_order(
    make_proxy: Callable[..., LiveServer], strict_backend: LiveServer, stream: bool
) -> None:
    proxy = make_proxy(upstream=strict_backend.url + "/v1")
    seen_varying(proxy)
    response = chat(proxy, asking(SYSTEM, "Where is my order?"), max_tokens=8, stream=stream)
    assert response.status_code == 200
    actions = response.headers["x-prefix-proxy-actions"]
    assert "retried_keeping_message_order" in actions
    assert "volatile_moved:system_end" in actions

    # From now on the model gets the client's order at once; the timestamp still moves.
    response = chat(
        proxy, asking(SYSTEM.replace("14:03:11", "14:04:52"), "And my invoice?"), max_tokens=8, stream=stream
    )
    assert response.status_code == 200
    assert "retried" not in response.headers["x-prefix-proxy-actions"]
    assert "volatile_moved:system_end" in response.headers["x-prefix-proxy-actions"]


def test_a_request_the_backend_refuses_anyway_reaches_the_client(
    make_proxy: Callable[..., LiveServer], strict_backend: LiveServer
) -> None:
    proxy = make_proxy(upstream=strict_backend.url + "/v1")
    seen_varying(proxy)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="fake-model",
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "the client's own late system message"},
                {"role": "user", "content": "again"},
            ],
        )
    assert "roles must alternate" in str(raised.value)
    # The client's own order was refused too, so the model is not marked: a later request still relocates.
    response = chat(proxy, asking(SYSTEM, "Where is my order?"), max_tokens=8)
    assert response.status_code == 200
    assert "retried_keeping_message_order" in response.headers["x-prefix-proxy-actions"]


def test_a_long_conversation_is_summarized_into_the_one_system_message(
    make_proxy: Callable[..., LiveServer], strict_backend: LiveServer
) -> None:
    """Compaction on a strict template: the summary joins the system message (a second one would be
    refused), before the moved timestamp, so the prefix up to the summary stays byte-identical."""
    proxy = make_proxy(
        upstream=strict_backend.url + "/v1",
        budget={"context_limit_tokens": 900},
        summarizer={"max_summary_tokens": 60, "keep_last_turns": 2},
    )
    history: list[dict[str, Any]] = []
    for turn in range(16):
        system = SYSTEM.replace("14:03:11", f"14:{turn + 10:02d}:00")
        history.append({"role": "user", "content": f"Turn {turn}: where is parcel {turn}, and when does it arrive?"})
        body = {"model": "fake-model", "max_tokens": 40, "messages": [{"role": "system", "content": system}, *history]}
        response = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] <= 900
        history.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
        time.sleep(0.05)  # background compaction
    actions = response.headers["x-prefix-proxy-actions"]
    assert "summary_in_system_message" in actions, actions
    prompts = [r["prompt_text"] for r in httpx.get(strict_backend.url + "/fake/requests", params={"limit": 64}).json()]
    summarized = [p for p in prompts if SUMMARY_HEADER in p and "Write a summary" not in p]
    assert summarized
    last = summarized[-1]
    # Summary, then the moved timestamp, inside the first (only) system block.
    assert last.index(SUMMARY_HEADER) < last.index("Current time:") < last.index("<|im_end|>")
