"""Anthropic Messages, Responses and the passed-through routes on the real engine, through the
proxy, with the real SDKs: a few requests each (the engine is shared with the other tests)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from bench.real_vllm.engine import RealVLLM
from proxy.app import create_app
from proxy.config import Settings
from tests.helpers import LiveServer

pytestmark = pytest.mark.real_engine

TOOLS: list[Any] = [
    {
        "name": "read_file",
        "description": "Read a file of the repository",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    }
]


@pytest.fixture(scope="module")
def proxy_url(real_vllm: RealVLLM) -> Iterator[str]:
    with LiveServer(create_app(Settings(upstream=real_vllm.openai_base_url))) as proxy:
        yield proxy.url


def system(run: str, date: str) -> list[Any]:
    return [
        {"type": "text", "text": f"Run {run}. You are a coding agent working in a repository. Be careful. " * 12},
        {"type": "text", "text": f"<env>\nToday's date: {date}\n</env>", "cache_control": {"type": "ephemeral"}},
    ]


def test_messages_sessions_share_the_prefix_and_usage_is_vllms(real_vllm: RealVLLM, proxy_url: str) -> None:
    client = anthropic.Anthropic(base_url=proxy_url, api_key="x", max_retries=0, timeout=120)
    run = secrets.token_hex(4)
    cached = []
    for date in ("2025-06-01", "2025-06-02", "2025-06-03"):
        before = real_vllm.metrics()
        raw = client.messages.with_raw_response.create(
            model=real_vllm.model,
            max_tokens=8,
            system=system(run, date),
            tools=TOOLS,
            messages=[{"role": "user", "content": "Read the README."}],
        )
        reply = raw.parse()
        delta = real_vllm.metrics() - before
        usage = reply.usage
        read, created = usage.cache_read_input_tokens or 0, usage.cache_creation_input_tokens or 0
        # What vLLM counted is what its answer said, and what the proxy read from it.
        assert usage.input_tokens + read + created == delta.queries == int(raw.headers["x-prefix-proxy-prompt-tokens"])
        assert read == delta.hits == int(raw.headers["x-prefix-proxy-cached-tokens"])
        cached.append(read)
    assert cached[0] == 0
    assert cached[2] >= 200  # the date moved out: the instructions and the tools are shared


def test_messages_stream_and_count_tokens(real_vllm: RealVLLM, proxy_url: str) -> None:
    client = anthropic.Anthropic(base_url=proxy_url, api_key="x", max_retries=0, timeout=120)
    body: dict[str, Any] = {
        "model": real_vllm.model,
        "max_tokens": 16,
        "system": "You are brief.",
        "messages": [{"role": "user", "content": f"Say something about {secrets.token_hex(3)}."}],
    }
    with client.messages.stream(**body) as events:
        kinds = [event.type for event in events]
        final = events.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.usage.output_tokens > 0
    counted = client.messages.count_tokens(model=real_vllm.model, system=body["system"], messages=body["messages"])
    direct = httpx.post(
        real_vllm.base_url + "/v1/messages/count_tokens",
        json={k: body[k] for k in ("model", "system", "messages")},
        timeout=60,
    ).json()
    assert counted.input_tokens == direct["input_tokens"] > 0
    bad = httpx.post(proxy_url + "/v1/messages", json={"model": real_vllm.model, "messages": []}, timeout=60)
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_responses_stateless_chain_and_retrieve(real_vllm: RealVLLM, proxy_url: str) -> None:
    client = openai.OpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0, timeout=120)
    instructions = f"Run {secrets.token_hex(4)}. You are an operations agent. Ground answers in data. " * 12
    tools: list[Any] = [
        {
            "type": "function",
            "name": "get_metrics",
            "parameters": {"type": "object", "properties": {"service": {"type": "string"}}},
        }
    ]
    first = client.responses.create(
        model=real_vllm.model, instructions=instructions, input="Check checkout.", tools=tools, max_output_tokens=24
    )
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 0
    with client.responses.stream(
        model=real_vllm.model, instructions=instructions, input="Check payments.", tools=tools, max_output_tokens=24
    ) as events:
        kinds = {event.type for event in events}
        second = events.get_final_response()
    assert {"response.created", "response.completed"} <= kinds
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens >= 200
    chained = client.responses.create(
        model=real_vllm.model, input="And now?", previous_response_id=first.id, max_output_tokens=8
    )
    assert chained.previous_response_id == first.id
    assert client.responses.retrieve(chained.id).id == chained.id


def test_passed_through_routes(real_vllm: RealVLLM, proxy_url: str) -> None:
    body = {"model": real_vllm.model, "prompt": "hello prefix cache"}
    through = httpx.post(proxy_url + "/tokenize", json=body, timeout=60)
    assert through.status_code == 200
    assert (
        through.json()["tokens"] == httpx.post(real_vllm.base_url + "/tokenize", json=body, timeout=60).json()["tokens"]
    )
    assert httpx.get(proxy_url + "/version", timeout=60).json()["version"]
    assert httpx.post(proxy_url + "/reset_prefix_cache", timeout=60).status_code == 403  # operator route
