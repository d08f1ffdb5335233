"""/v1/responses through the proxy with the real OpenAI SDK, against fake vLLM backends."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from proxy.app import create_app
from proxy.config import Settings
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "list_files",
        "description": "List the files of a directory",
        "parameters": {"type": "object", "properties": {"dir": {"type": "string"}}},
    }
]
INSTRUCTIONS = "You are a careful software agent. Explain what you do.\n" * 6


def requests_to(backend: LiveServer) -> list[dict[str, Any]]:
    return [r for r in httpx.get(backend.url + "/fake/requests").json() if r["endpoint"] == "/v1/responses"]


def test_stateless_conversation_is_canonicalized(proxy: LiveServer, fake_backend: LiveServer) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    cached = []
    for minute in ("00", "05", "10"):
        instructions = f"{INSTRUCTIONS}Current time: 2025-06-01T10:{minute}:00Z"
        items: list[Any] = [{"role": "user", "content": "List the files in src"}]
        first = client.responses.create(
            model="fake-model", instructions=instructions, input=items, tools=TOOLS, max_output_tokens=40, store=False
        )
        cached.append(first.usage.input_tokens_details.cached_tokens if first.usage else 0)
        forwarded = requests_to(fake_backend)[-1]["body"]
    # From the second session on the time is moved: the instructions and tools hit.
    assert cached[2] >= 128
    assert "Current time" not in forwarded["instructions"]
    assert {"role": "system", "content": "Current time: 2025-06-01T10:10:00Z"} in forwarded["input"]


@pytest.mark.parametrize("stream", [False, True])
def test_usage_is_the_backends(proxy: LiveServer, fake_backend: LiveServer, stream: bool) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    kwargs: dict[str, Any] = {"model": "fake-model", "input": "Say hi", "max_output_tokens": 20}
    if stream:
        with client.responses.stream(**kwargs) as events:
            kinds = {event.type for event in events}
            response = events.get_final_response()
        assert {"response.created", "response.output_text.delta", "response.completed"} <= kinds
    else:
        response = client.responses.create(**kwargs)
    record = requests_to(fake_backend)[-1]
    assert response.usage is not None
    assert response.usage.input_tokens == record["prompt_tokens"]
    assert response.usage.input_tokens_details.cached_tokens == record["cached_tokens"]
    assert response.output_text


@pytest.fixture
def two_backends() -> Iterator[tuple[LiveServer, LiveServer]]:
    servers = (
        LiveServer(create_fake_app(FakeBackendConfig())).start(),
        LiveServer(create_fake_app(FakeBackendConfig())).start(),
    )
    yield servers
    for server in servers:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_chain_sticks_to_the_backend_holding_it(two_backends: tuple[LiveServer, LiveServer], stream: bool) -> None:
    upstreams = [b.url + "/v1" for b in two_backends]
    proxy = LiveServer(create_app(Settings(upstreams=upstreams, routing={"policy": "round_robin"}))).start()
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        previous: str | None = None
        sessions = set()
        for turn in range(4):
            kwargs: dict[str, Any] = {
                "model": "fake-model",
                "instructions": INSTRUCTIONS,
                "input": [{"role": "user", "content": f"step {turn}: continue"}],
                "max_output_tokens": 30,
                "previous_response_id": previous,
            }
            if stream:
                raw = client.responses.with_raw_response.create(stream=True, **kwargs)
                sessions.add(raw.headers.get("x-prefix-proxy-session"))
                events = list(raw.parse())
                response = events[-1].response
            else:
                raw = client.responses.with_raw_response.create(**kwargs)
                sessions.add(raw.headers.get("x-prefix-proxy-session"))
                response = raw.parse()
            previous = response.id
        counts = [len(requests_to(b)) for b in two_backends]
        assert sorted(counts) == [0, 4]  # round robin would have alternated: the chain is pinned
        assert len(sessions) == 1 and None not in sessions  # one chain, one session
        assert client.responses.retrieve(previous).id == previous
    finally:
        proxy.stop()


def test_stored_responses_are_per_tenant(fake_backend: LiveServer) -> None:
    tenants = [{"name": "acme", "api_key": "sk-acme"}, {"name": "globex", "api_key": "sk-globex"}]
    proxy = LiveServer(create_app(Settings(upstream=fake_backend.url + "/v1", tenants=tenants))).start()
    try:
        acme = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-acme", max_retries=0)
        globex = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-globex", max_retries=0)
        response = acme.responses.create(model="fake-model", input="hello", max_output_tokens=10)
        assert acme.responses.retrieve(response.id).id == response.id
        with pytest.raises(openai.NotFoundError):
            globex.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            globex.responses.create(model="fake-model", input="more", previous_response_id=response.id)
        follow = acme.responses.create(model="fake-model", input="more", previous_response_id=response.id)
        assert follow.previous_response_id == response.id
    finally:
        proxy.stop()


@pytest.mark.parametrize(
    "body",
    [
        {"model": "fake-model"},
        {"model": "fake-model", "input": 5},
        {"model": "fake-model", "input": [1]},
        {"model": "fake-model", "input": "x", "previous_response_id": 3},
        {"model": "fake-model", "input": "x", "tools": {}},
        {"model": "fake-model", "input": [{"role": "user", "content": 7}]},
    ],
)
def test_bad_input_is_openai_400(proxy: LiveServer, body: dict[str, Any]) -> None:
    response = httpx.post(proxy.url + "/v1/responses", json=body)
    assert response.status_code == 400
    assert isinstance(response.json()["error"]["message"], str)


def test_unknown_previous_response_is_404(proxy: LiveServer) -> None:
    response = httpx.post(
        proxy.url + "/v1/responses", json={"model": "fake-model", "input": "x", "previous_response_id": "resp_nope"}
    )
    assert response.status_code == 404
    assert httpx.get(proxy.url + "/v1/responses/resp_nope").status_code == 404
    # never the backend's /v1/models: a path with ".." is refused
    assert httpx.get(proxy.url + "/v1/responses/..%2Fmodels").status_code == 400
