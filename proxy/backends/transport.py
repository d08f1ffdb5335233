"""The upstream transport: the one place an upstream request leaves the proxy.

An ``httpx.AsyncBaseTransport``, httpx's seam between a request and the network (as its own
``_transports/`` are): :meth:`proxy.backends.upstream.Upstream.open` hands it every request and
it answers an ``httpx.Response`` whose body is not yet read. Underneath is aiohttp's connection
pool, which measured less CPU per proxied request than httpx's own transport (bench/hop.py; the
figures are in docs/profiles/README.md).

aiohttp's errors become the httpx errors that mean the same, and the difference matters: the proxy
fails a request over to another backend only when it never left (or it could be computed twice).
A failure to connect is a connect error; anything after the connection was made is a read or
protocol error, during the request and while its body streams.

No cookie is kept: one transport serves every tenant, and a cookie an upstream sets for one must
never ride along on another's request (aiohttp's session gets a jar that keeps none; nothing
between ``Upstream`` and here handles cookies at all). No proxy from the environment is used.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType

import aiohttp
import httpx

# The body read whole in one call from aiohttp, past httpx's per-chunk layers (decoders, chunkers,
# one async generator per wrapper): a response extension, ``() -> Awaitable[bytes]``. For a body
# without a content-encoding only (see proxy.backends.upstream.read_response); the response is
# still closed as any other.
READ_ALL = "prefix_proxy_read_all"
CHUNK_SIZE = 16 * 1024
# aiohttp's timeout objects, one per distinct set of httpx timeouts (an upstream has one or two).
MAX_CACHED_TIMEOUTS = 16


def transport_error(exc: BaseException) -> httpx.TransportError | None:
    """The httpx error that ``exc`` (aiohttp's) means; None for one that is not aiohttp's."""
    if not isinstance(exc, aiohttp.ClientError):
        return None
    message = str(exc) or type(exc).__name__
    # Most specific first: aiohttp's connection timeout is also a server timeout and an OSError.
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # connecting, or waiting for a pooled connection
        return httpx.ConnectTimeout(message)
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return httpx.ReadTimeout(message)
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return httpx.TimeoutException(message)
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, DNS, TLS handshake
        return httpx.ConnectError(message)
    if isinstance(exc, aiohttp.ServerDisconnectedError):  # hung up after it read the request
        return httpx.RemoteProtocolError(message)
    if isinstance(exc, aiohttp.ClientOSError | aiohttp.ClientPayloadError):
        return httpx.ReadError(message)
    if isinstance(exc, aiohttp.ClientResponseError):
        # An answer that is not HTTP (a bad status line, a body on a HEAD answer).
        return httpx.RemoteProtocolError(f"invalid upstream response: {exc.message}"[:200])
    if isinstance(exc, aiohttp.ClientConnectionError):
        # The connection closed before the request was written to it (a reset pooled connection),
        # or the server's certificate is not the pinned one: nothing was sent.
        return httpx.ConnectError(message)
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return httpx.UnsupportedProtocol(message)
    return None


class _MappedErrors:
    """Raises aiohttp's errors as :func:`transport_error` maps them.

    A class, not ``@contextmanager``: entered up to three times per proxied request, and a
    generator-based manager costs several times this."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is not None and (mapped := transport_error(exc)) is not None:
            raise mapped from exc


_mapped_errors = _MappedErrors()


class _Body(httpx.AsyncByteStream):
    """aiohttp's response body, its errors mapped as for the request."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped_errors:
            async for chunk in self._response.content.iter_chunked(CHUNK_SIZE):
                yield chunk

    async def read_all(self) -> bytes:
        with _mapped_errors:
            return await self._response.read()

    async def aclose(self) -> None:
        with _mapped_errors:
            await self._response.__aexit__(None, None, None)


def read_all(response: httpx.Response) -> Callable[[], Awaitable[bytes]] | None:
    """The transport's one-call read of ``response``'s body (identity-encoded only), or None where
    it has none (another transport: a test's ``httpx.MockTransport``)."""
    reader = response.extensions.get(READ_ALL)
    return reader if callable(reader) else None


def upstream_tls_context() -> ssl.SSLContext:
    """How backends' certificates are verified: certifi's CAs, or those SSL_CERT_FILE / SSL_CERT_DIR
    name (replacing certifi's), which is how a pod is told to trust a private CA (redis-py's
    rediss:// reads them too). Raises OSError / ssl.SSLError where they name nothing loadable
    (``tls_problem`` says so before start)."""
    return httpx.create_ssl_context(trust_env=True)


def tls_problem() -> str | None:
    """Why the upstream client could not verify certificates as the environment asks (one line
    naming the variable), or None."""
    try:
        upstream_tls_context()
    except (OSError, ssl.SSLError) as error:
        # httpx reads SSL_CERT_FILE where it is set, else SSL_CERT_DIR.
        name = next((name for name in ("SSL_CERT_FILE", "SSL_CERT_DIR") if os.environ.get(name)), None)
        named = f"{name}={os.environ[name]}" if name else "the CA certificates"
        reason = getattr(error, "strerror", None) or str(error)
        return f"{named}: the upstream client cannot load it ({reason}): give a PEM file of CA certificates or unset it"
    return None


class UpstreamTransport(httpx.AsyncBaseTransport):
    """httpx's request in, httpx's response out (its body not yet read), aiohttp's pool underneath.

    ``limits``: ``max_connections`` (None: no limit) and ``keepalive_expiry`` (how long an idle
    connection is kept). Proxies from the environment are not used (aiohttp's ``trust_env`` off):
    every upstream request goes where its URL says.
    """

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._ssl: ssl.SSLContext | None = None  # made with the session (upstream_tls_context)
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[tuple[float | None, float | None, float | None], aiohttp.ClientTimeout] = {}

    def _open_session(self) -> aiohttp.ClientSession:
        # Made on the first request, inside the event loop that serves them.
        if self._ssl is None:
            self._ssl = upstream_tls_context()
        connector = aiohttp.TCPConnector(
            limit=self._limits.max_connections or 0,
            keepalive_timeout=self._limits.keepalive_expiry,
            ssl=self._ssl,
        )
        # aiohttp keeps the cookies of named hosts by default: this jar keeps none.
        self._session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False, auto_decompress=False
        )
        return self._session

    def _timeout(self, timeouts: object) -> aiohttp.ClientTimeout:
        """httpx's timeouts (the request's ``timeout`` extension) in aiohttp's terms: its connect
        timeout includes the wait for a pooled connection (httpx's pool timeout)."""
        get = timeouts.get if isinstance(timeouts, dict) else {}.get
        key = (get("connect"), get("read"), get("pool"))
        timeout = self._timeouts.get(key)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(sock_connect=key[0], sock_read=key[1], connect=key[2])
            if len(self._timeouts) < MAX_CACHED_TIMEOUTS:
                self._timeouts[key] = timeout
        return timeout

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._session or self._open_session()
        pairs = request.headers.multi_items()  # names in lower case
        stream = request.stream
        data: bytes | httpx.AsyncByteStream | None
        if isinstance(stream, httpx.ByteStream):
            # A body in memory, sent whole with its length (aiohttp writes Content-Length).
            data = request.read() or None
        elif isinstance(stream, httpx.AsyncByteStream):
            # A streamed body, sent as it comes: chunked, aiohttp writes the framing.
            data = stream
            pairs = [(name, value) for name, value in pairs if name != "transfer-encoding"]
        else:
            raise TypeError(f"an upstream request body must be in memory or asynchronous, not {type(stream).__name__}")
        with _mapped_errors:
            response = await session.request(
                request.method,
                str(request.url),
                headers=pairs,
                data=data,
                allow_redirects=False,
                compress=False,
                timeout=self._timeout(request.extensions.get("timeout")),
            )
        body = _Body(response)
        extensions: dict[str, object] = {"http_version": b"HTTP/1.1", READ_ALL: body.read_all}
        if response.reason:
            extensions["reason_phrase"] = response.reason.encode("ascii", "replace")
        return httpx.Response(response.status, headers=response.raw_headers, stream=body, extensions=extensions)

    async def aclose(self) -> None:
        # The closed session stays: a request after this is aiohttp's RuntimeError, not a new pool.
        if self._session is not None:
            await self._session.close()
