"""The one upstream transport against real servers (uvicorn): what every upstream request meets.

No cookie rides from one client's request to another's, whatever the route; a body goes out and
comes back as it is produced, never gathered first; ``max_connections`` bounds the requests open
at once. (How its failures map to the proxy's errors: tests/test_upstream_errors.py.)
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.backends.upstream import Upstream
from proxy.config import Settings
from testbed.serving import LiveServer

MODEL = "fake-model"
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}
CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL}


class CookieSettingUpstream:
    """An upstream that answers every request with a cookie naming the client it came from, and
    records the ``Cookie`` header of each request it got (after the proxy's start-up probe)."""

    def __init__(self) -> None:
        self.cookies: list[tuple[str, str | None]] = []

    def _answer(self, request: Request, response: Response) -> Response:
        client = request.headers.get("authorization", "none").removeprefix("Bearer ")
        self.cookies.append((f"{request.method} {request.url.path}", request.headers.get("cookie")))
        response.set_cookie("owner", client, path="/")
        response.set_cookie("tenant_session", f"{client}-secret", path="/v1")
        return response

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        if not body.get("stream"):
            return self._answer(request, JSONResponse(COMPLETION))

        async def events() -> AsyncIterator[bytes]:
            delta = {**CHUNK, "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}
            yield b"data: " + json.dumps(delta).encode() + b"\n\n"
            usage = {**CHUNK, "choices": [], "usage": COMPLETION["usage"]}
            yield b"data: " + json.dumps(usage).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return self._answer(request, StreamingResponse(events(), media_type="text/event-stream"))

    async def models(self, request: Request) -> Response:
        return self._answer(request, JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))

    async def other(self, request: Request) -> Response:
        size = len(await request.body())
        return self._answer(request, JSONResponse({"received": size}))

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/files", self.other, methods=["POST"]),
                Route("/tokenize", self.other, methods=["POST"]),
            ]
        )


def test_no_cookie_an_upstream_sets_reaches_another_clients_request() -> None:
    """Two clients take turns on every kind of request the proxy sends upstream: a whole answer, a
    stream, the model listing, a JSON body passed through, a streamed upload. The upstream sets a
    cookie on each answer (on a named host, whose cookies a jar would keep); no request of either
    client carries one, nor does the proxy's own health probing."""
    upstream = CookieSettingUpstream()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    with LiveServer(upstream.app()) as backend:
        settings = Settings(upstream=f"http://localhost:{backend.port}/v1")
        with LiveServer(create_app(settings)) as proxy:
            for round_ in range(2):
                for client in ("key-a", "key-b"):
                    headers = {"authorization": f"Bearer {client}"}
                    with httpx.Client(base_url=proxy.url, headers=headers, timeout=30) as http:
                        assert http.post("/v1/chat/completions", json=chat).status_code == 200
                        streamed = http.post("/v1/chat/completions", json={**chat, "stream": True})
                        assert streamed.status_code == 200 and "[DONE]" in streamed.text
                        assert http.get("/v1/models").status_code == 200
                        assert http.post("/v1/files", json={"round": round_}).json()["received"] > 0
                        upload = http.post(
                            "/v1/files", content=b"x" * 70_000, headers={"content-type": "application/octet-stream"}
                        )
                        assert upload.json() == {"received": 70_000}
                        assert http.get("/readyz").status_code == 200
    seen = {route for route, _ in upstream.cookies}
    assert {"POST /v1/chat/completions", "GET /v1/models", "POST /v1/files"} <= seen
    assert [cookie for _, cookie in upstream.cookies if cookie is not None] == []


def test_a_streamed_body_goes_out_and_comes_back_as_it_is_produced() -> None:
    """The client sends the rest of its body only once the upstream has its first chunk, and the
    upstream sends the rest of its answer only once the client has the answer's first chunk: a
    transport that gathered either body first would wait forever."""
    request_started = threading.Event()
    answer_started = threading.Event()

    async def echo(request: Request) -> Response:
        chunks = []
        async for chunk in request.stream():
            chunks.append(chunk)
            request_started.set()
        received = b"".join(chunks)

        async def answer() -> AsyncIterator[bytes]:
            yield b"got:" + received
            assert await asyncio.to_thread(answer_started.wait, 10)
            yield b"|rest"

        return StreamingResponse(answer(), media_type="application/octet-stream")

    async def body() -> AsyncIterator[bytes]:
        yield b"one"
        assert await asyncio.to_thread(request_started.wait, 10)
        yield b"two"

    async def exchange(url: str) -> list[bytes]:
        upstream = Upstream(url)
        try:
            response = await upstream.open("POST", "/echo", content=body(), headers={"x-test": "1"})
            chunks = []
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                answer_started.set()
            await response.aclose()
            return chunks
        finally:
            await upstream.aclose()

    with LiveServer(Starlette(routes=[Route("/v1/echo", echo, methods=["POST"])])) as server:
        chunks = asyncio.run(asyncio.wait_for(exchange(f"http://127.0.0.1:{server.port}/v1"), 20))
    assert chunks[0].startswith(b"got:onetwo") and b"".join(chunks) == b"got:onetwo|rest"


def test_max_connections_bounds_the_requests_open_at_once() -> None:
    in_flight = 0
    most = 0
    lock = threading.Lock()

    async def slow(request: Request) -> Response:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        await asyncio.sleep(0.2)
        with lock:
            in_flight -= 1
        return JSONResponse({})

    async def many(url: str) -> list[Any]:
        upstream = Upstream(url, max_connections=2)
        try:

            async def one() -> bytes:
                return await upstream.read(await upstream.open("POST", "/slow", content=b"{}"))

            return await asyncio.gather(*(one() for _ in range(6)))
        finally:
            await upstream.aclose()

    with LiveServer(Starlette(routes=[Route("/v1/slow", slow, methods=["POST"])])) as server:
        answers = asyncio.run(many(f"http://127.0.0.1:{server.port}/v1"))
    assert answers == [b"{}"] * 6
    assert most == 2
