"""httpx-aiohttp's transport, with aiohttp's errors mapped to the httpx errors that mean the same.

httpx-aiohttp maps every ``aiohttp.ClientConnectionError`` to ``httpx.ConnectTimeout``: a
connection refused, and a connection the upstream dropped after it read the request, both read
as "the request never left". The proxy fails a request over to another backend only when it
never left (or it could be computed twice), so the difference matters: here a failure to connect
stays a connect error, and anything after the connection was made becomes a read or protocol
error, during the request and while its body streams.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport
from httpx_aiohttp.transport import AiohttpResponseStream, map_aiohttp_exceptions


def _remap(exc: httpx.TransportError) -> httpx.TransportError:
    cause = exc.__cause__
    message = str(exc) or type(cause).__name__
    # Most specific first: aiohttp's connection timeout is also a server timeout and an OSError.
    if isinstance(cause, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message)
    if isinstance(cause, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message)
    if isinstance(cause, aiohttp.SocketTimeoutError):
        return httpx.ReadTimeout(message)
    if isinstance(cause, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(message)
    if isinstance(cause, aiohttp.ClientOSError | aiohttp.ClientPayloadError):
        return httpx.ReadError(message)
    return exc


class _MappedErrors:
    """aiohttp's errors as httpx-aiohttp maps them, then remapped to what they mean (above).

    A class, not ``@contextmanager`` over httpx-aiohttp's own: entered three times per proxied
    request, and a generator-based manager (two of them nested) costs several times this."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if not isinstance(exc, Exception):
            return
        mapped = exc if isinstance(exc, httpx.TransportError) else _httpx_aiohttp_error(exc)
        if mapped is None:
            if isinstance(exc, aiohttp.ClientResponseError):
                # An answer that is not HTTP (a bad status line, a body on a HEAD answer): httpx-aiohttp
                # lets aiohttp's own error through, which would be a 500 of the proxy's.
                raise httpx.RemoteProtocolError(f"invalid upstream response: {exc.message}"[:200]) from exc
            return
        remapped = _remap(mapped)
        if remapped is not exc:
            raise remapped from mapped.__cause__


def _httpx_aiohttp_error(exc: Exception) -> httpx.TransportError | None:
    """What httpx-aiohttp's own mapping raises for ``exc`` (caused by it); None where it lets
    ``exc`` through."""
    try:
        with map_aiohttp_exceptions():
            raise exc
    except httpx.TransportError as mapped:
        return mapped
    except Exception:
        return None


_mapped_errors = _MappedErrors()


class _MappedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except httpx.TransportError as exc:
            raise _remap(exc) from exc.__cause__

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        except httpx.TransportError as exc:
            raise _remap(exc) from exc.__cause__


class WholeBodyStream(httpx.AsyncByteStream):
    """A response body that can also be read whole in one call (a JSON answer), past httpx's
    per-chunk layers (decoders, chunkers, one async generator per wrapper)."""

    async def read_all(self) -> bytes:
        return b"".join([chunk async for chunk in self])


class _AiohttpBody(WholeBodyStream):
    """aiohttp's response body, its errors mapped as for the request."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped_errors:
            async for chunk in self._response.content.iter_chunked(AiohttpResponseStream.CHUNK_SIZE):
                yield chunk

    async def read_all(self) -> bytes:
        with _mapped_errors:
            return await self._response.read()

    async def aclose(self) -> None:
        with _mapped_errors:
            await self._response.__aexit__(None, None, None)


class ProxyAiohttpTransport(AiohttpTransport):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._aiohttp_timeouts: dict[tuple[float | None, float | None, float | None], aiohttp.ClientTimeout] = {}

    def get_client(self) -> aiohttp.ClientSession:
        if self.client is not None:
            return super().get_client()
        connector = aiohttp.TCPConnector(
            limit=self.limits.max_connections or 0,
            keepalive_timeout=self.limits.keepalive_expiry,
            ssl=self.ssl_context,
        )
        # One session serves every tenant: a cookie an upstream sets for one must never ride along
        # on another's request (aiohttp keeps cookies of named hosts by default).
        return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        with _mapped_errors:
            response = await super().handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _MappedStream(response.stream)
        return response

    async def send_bytes(
        self, method: str, url: str, content: bytes | None, headers: Mapping[str, str], timeout: httpx.Timeout
    ) -> httpx.Response:
        """A request whose body is whole, straight to aiohttp: httpx's client and request models
        around it (header merging, the auth and redirect flows) cost ~5% of a proxied request's CPU."""
        if not isinstance(self.client, aiohttp.ClientSession):
            self.client = self.get_client()
        # The same timeouts handle_async_request derives from httpx's (an upstream has one set).
        key = (timeout.connect, timeout.read, timeout.pool)
        aiohttp_timeout = self._aiohttp_timeouts.get(key)
        if aiohttp_timeout is None:
            aiohttp_timeout = aiohttp.ClientTimeout(sock_connect=key[0], sock_read=key[1], connect=key[2])
            if len(self._aiohttp_timeouts) < 16:
                self._aiohttp_timeouts[key] = aiohttp_timeout
        with _mapped_errors:
            response = await self.client.request(
                method,
                url,
                headers=headers,
                data=content or None,
                allow_redirects=False,
                auto_decompress=False,
                compress=False,
                timeout=aiohttp_timeout,
            ).__aenter__()
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_AiohttpBody(response),
            extensions={"http_version": b"HTTP/1.1"},
        )
