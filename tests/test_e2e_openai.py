"""The real proxy (uvicorn, real port) in front of the fake backend, driven by the openai SDK."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import LiveServer

MODEL = "fake-model"
LONG_SYSTEM = "You are a meticulous support assistant for an online bookshop. " * 40
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by its number.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            },
        },
    }
]


@pytest.fixture
def client(proxy: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]


def test_non_stream_chat_reports_usage_and_headers(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=conversation("Where is my order?"))
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.prompt_tokens > 400
    assert float(raw.headers["x-prefix-proxy-overhead-ms"]) >= 0
    assert raw.headers["x-prefix-proxy-cached-tokens"] == "0"
    assert raw.headers["x-request-id"]
    assert len(raw.headers["x-prefix-proxy-prefix"]) == 16

    again = client.chat.completions.with_raw_response.create(model=MODEL, messages=conversation("And my refund?"))
    cached = int(again.headers["x-prefix-proxy-cached-tokens"])
    assert cached > 400 and cached % 16 == 0
    assert again.parse().usage.prompt_tokens_details.cached_tokens == cached


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=conversation("hi"), stream=True))
    assert chunks, "the stream is not empty"
    assert all(chunk.usage is None for chunk in chunks)
    assert all(chunk.choices for chunk in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


def test_stream_with_include_usage_ends_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=conversation("hi"), stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 400
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_round_trip(client: openai.OpenAI, stream: bool) -> None:
    messages: list = conversation("What happened to order 1234?")
    if stream:
        calls: dict[int, dict[str, str]] = {}
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True):
            for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] = (delta.function.name if delta.function else None) or entry["name"]
                entry["arguments"] += (delta.function.arguments if delta.function else None) or ""
        call = calls[0]
    else:
        message = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0].message
        assert message.tool_calls
        tool_call = message.tool_calls[0]
        call = {
            "id": tool_call.id,
            "name": tool_call.function.name,
            "arguments": tool_call.function.arguments,
        }
    assert call["name"] == "lookup_order"
    assert "order_id" in call["arguments"]

    # The client re-sends the call Dify-style: a fresh uuid and re-serialized arguments.
    fresh_id = str(uuid.uuid4())
    history = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": fresh_id,
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"].replace(": ", ":")},
                }
            ],
        },
        {"role": "tool", "tool_call_id": fresh_id, "content": "shipped yesterday"},
    ]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=history, tools=TOOLS)
    assert "tool_call_ids_restored:1" in raw.headers["x-prefix-proxy-actions"]
    assert raw.parse().choices[0].message.content


def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_stream_arrives_chunk_by_chunk(proxy: LiveServer) -> None:
    """The first chunk reaches the client long before the upstream has finished."""
    body = {
        "model": MODEL,
        "messages": conversation("tell me a story"),
        "stream": True,
        "max_tokens": 20,
        "fake_options": {"chunk_delay_s": 0.1},
    }
    started = time.perf_counter()
    arrivals: list[float] = []
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.headers["x-accel-buffering"] == "no"
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.perf_counter() - started)
    assert len(arrivals) > 5
    assert arrivals[-1] - arrivals[0] > 0.5, "chunks were spread over the upstream's generation time"
    assert arrivals[0] < arrivals[-1] / 2


def test_embeddings_pass_through(client: openai.OpenAI) -> None:
    result = client.embeddings.create(model=MODEL, input=["a", "b"])
    assert len(result.data) == 2 and len(result.data[0].embedding) > 0


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    assert client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True))
    assert chunks and all(c.usage is None for c in chunks)


def test_a_stream_the_upstream_breaks_off_ends_with_an_error_event(client: openai.OpenAI, proxy: LiveServer) -> None:
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": f"tell me a long story {uuid.uuid4()}"}],
        stream=True,
        extra_body={"fake_options": {"abort_after_chunks": 3}},  # the fake backend drops the connection
    )
    received = []
    with pytest.raises(openai.APIError, match="the upstream stream was interrupted"):
        for chunk in stream:
            received.extend(c.delta.content or "" for c in chunk.choices)
    assert received  # what came before the break reached the client
    metrics = httpx.get(proxy.url + "/metrics").text
    assert "prefix_proxy_streams_cancelled_total 1.0" in metrics


def _lingering_sse_backend() -> Any:
    """An upstream that sends a whole answer, [DONE] included, and only then, a second later, ends
    its body: a client that hangs up at [DONE] races that end."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def chat(request: Request) -> StreamingResponse:
        async def events() -> Any:
            chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
            delta = {"index": 0, "delta": {"role": "assistant", "content": "Hello"}, "finish_reason": None}
            yield f"data: {json.dumps({**chunk, 'choices': [delta]})}\n\n".encode()
            done = {"index": 0, "delta": {}, "finish_reason": "stop"}
            yield f"data: {json.dumps({**chunk, 'choices': [done]})}\n\n".encode()
            usage = {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}
            yield f"data: {json.dumps({**chunk, 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
            await asyncio.sleep(1.0)

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_a_client_that_hangs_up_at_done_still_completes_its_turn(make_proxy: Any) -> None:
    upstream = LiveServer(_lingering_sse_backend()).start()
    proxy = make_proxy(upstream=upstream.url + "/v1")
    try:
        headers = {"x-session-id": f"done-{uuid.uuid4()}"}
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, headers=headers) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    break  # and the connection closes, as SDKs do
        session = response.headers["x-prefix-proxy-session"]
        time.sleep(0.3)
        state = httpx.get(f"{proxy.url}/v1/sessions/{session}", headers=headers)
        assert state.status_code == 200 and state.json()["requests"] == 1  # the turn was recorded
        assert "prefix_proxy_streams_cancelled_total 0.0" in httpx.get(proxy.url + "/metrics").text
    finally:
        upstream.stop()


def test_a_conversation_with_nothing_varying_reaches_the_backend_byte_identical(
    client: openai.OpenAI, fake_backend: LiveServer
) -> None:
    """Through the whole proxy (sessions, budgets, summaries on defaults): client text with CRLF,
    trailing blanks, non-NFC text, code and a constant date arrives exactly as sent, every turn."""
    system = (
        "You review Python code.\r\n\r\nToday is 2026-11-30 (Monday).\r\n"
        "Keep answers short.  \r\n<context>\r\n</context>\r\nCafe\u0301 rules apply.\t"
    )
    tag = uuid.uuid4().hex
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"[{tag}] turn {turn}:\n```py\ndef f(x):  \n    return x \n```\n"})
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]
        log = httpx.get(fake_backend.url + "/fake/requests", params={"limit": 256}).json()
        received = [r["body"] for r in log if tag in json.dumps(r["body"])]
        latest = max(received, key=lambda body: len(body["messages"]))
        assert json.dumps(latest["messages"]) == json.dumps(messages), f"turn {turn}"
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
