"""What the upstream transport raises when an upstream misbehaves, against real sockets.

The proxy retries a request on another backend only when it never left (a connect error); after
that the backend may be computing it. So the mapping of aiohttp's errors decides between a
failover and a 502: each case here is a real server behaving so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from proxy.backends.transport import UpstreamTransport
from tests.helpers import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
REQUEST = b'{"model": "m", "messages": []}'


@contextlib.asynccontextmanager
async def upstream(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)


async def send(url: str, read_s: float = 5.0) -> httpx.Response:
    transport = UpstreamTransport(httpx.Limits(max_connections=4))
    timeout = httpx.Timeout(read_s, connect=2.0).as_dict()
    request = httpx.Request(
        "POST", url, content=REQUEST, headers={"content-type": "application/json"}, extensions={"timeout": timeout}
    )
    try:
        response = await transport.handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        await response.aread()
        return response
    finally:
        await transport.aclose()


async def test_a_refused_connection_is_a_connect_error() -> None:
    with pytest.raises(httpx.ConnectError):
        await send(f"http://127.0.0.1:{free_port()}/v1/chat/completions")


def answering(raw: bytes, after_s: float = 0.0) -> Handler:
    """An upstream that reads the request, waits ``after_s``, writes ``raw`` and hangs up."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(after_s)
        writer.write(raw)
        await writer.drain()
        writer.close()

    return handle


async def test_a_connection_dropped_after_the_request_is_not_a_connect_error() -> None:
    async with upstream(answering(b"")) as url:
        with pytest.raises(httpx.RemoteProtocolError):
            await send(url)


async def test_an_answer_that_is_not_http_is_a_protocol_error() -> None:
    async with upstream(answering(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")) as url:
        with pytest.raises(httpx.RemoteProtocolError, match="invalid upstream response"):
            await send(url)


async def test_a_silent_upstream_is_a_read_timeout() -> None:
    async with upstream(answering(b"", after_s=0.5)) as url:
        with pytest.raises(httpx.ReadTimeout):
            await send(url, read_s=0.2)


async def test_a_body_cut_short_is_a_read_error() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    async with upstream(answering(head + b'{"id":')) as url:
        with pytest.raises(httpx.ReadError):
            await send(url)


async def test_a_good_answer_comes_through() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"
    async with upstream(answering(head + b"{}")) as url:
        response = await send(url)
    assert (response.status_code, response.content) == (200, b"{}")
