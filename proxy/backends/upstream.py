"""The upstream OpenAI-compatible server (vLLM, or anything that speaks its API).

Every request to an upstream is an ``httpx.Request`` handed to its transport, the one seam between
the proxy and the network (:class:`proxy.backends.transport.UpstreamTransport`, aiohttp's pool
underneath; a test gives another, e.g. ``httpx.MockTransport``), which answers an
``httpx.Response`` whose body is not yet read. Transport failures become OpenAI-shaped 502/504
errors so no client ever sees a stack trace.

No ``httpx.AsyncClient`` stands in between: what it would add (auth, timeouts, redirects, cookie
persistence, event hooks) is a header, a request extension, or must not happen to a proxy, and
its layers measured 60-160 us of CPU a request (docs/profiles/README.md). In particular nothing here
keeps a cookie: one upstream serves every tenant, and a cookie it sets for one must never ride
along on another's request (the transport's aiohttp session has a jar that keeps none).
"""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Any

import httpx

from proxy.backends.transport import UpstreamTransport, read_all
from proxy.http import (
    UpstreamConnectionLost,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from proxy.openai import loads

MAX_CACHED_URLS = 256
# What stands in an upstream's answer for a credential the proxy sent it.
REDACTED = b"[redacted]"
# A URL's password alone is redacted from this length on (a shorter one would blank out words).
MIN_REDACTED_PASSWORD = 4


async def read_response(response: httpx.Response) -> bytes:
    """Read a response body, mapping a mid-body timeout or drop to :class:`UpstreamTimeout` (504) or
    :class:`UpstreamConnectionLost` (502)."""
    try:
        # An identity-encoded body in one read from the transport; one to decode through httpx.
        reader = read_all(response) if "content-encoding" not in response.headers else None
        return await reader() if reader is not None else await response.aread()
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout() from exc
    except httpx.TransportError as exc:
        raise UpstreamConnectionLost(type(exc).__name__) from exc
    finally:
        await response.aclose()


class _Streamed(httpx.AsyncByteStream):
    """A body the caller streams (a client's upload), as an httpx request body."""

    def __init__(self, chunks: AsyncIterable[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk


def model_list(response: httpx.Response) -> list[dict[str, Any]]:
    """The ``data`` of a ``/models`` answer; ``[]`` for anything else."""
    try:
        data = loads(response.content).get("data") if response.status_code == 200 else None
    except (ValueError, AttributeError):
        return []
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


class Upstream:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        connect_timeout_s: float = 5.0,
        timeout_s: float = 600.0,
        max_connections: int = 1000,
        keepalive_s: float = 4.0,
        transport: httpx.AsyncBaseTransport | None = None,
        use_aiohttp: bool = True,
    ) -> None:
        """``transport``: another transport than the upstream one (a test's ``httpx.MockTransport``).
        ``use_aiohttp`` is ignored: there is one upstream transport (``upstream_transport`` in
        proxy/config.py)."""
        url = httpx.URL(base_url)
        # Every form in which this upstream's own credentials leave the proxy, to be scrubbed from
        # what it answers (an error page that echoes the request's headers): see :class:`Redactor`.
        self.credentials = credential_forms(api_key, url)
        # Credentials in the URL (http://user:pw@host/v1) are sent as HTTP Basic auth, replacing any
        # other Authorization; the URL used for requests carries none (aiohttp refuses a URL with
        # credentials next to an Authorization header, and a URL is easier to leak than a header).
        self._basic_auth: str | None = None
        if url.userinfo:
            token = base64.b64encode(f"{url.username}:{url.password}".encode()).decode("ascii")
            self._basic_auth = f"Basic {token}"
            base_url = str(url.copy_with(userinfo=b""))
        self.base_url = base_url.rstrip("/")
        # vLLM serves /tokenize, /health and /metrics at the server root, not under /v1.
        self.root_url = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self._api_key = api_key
        self._urls: dict[tuple[str, bool], httpx.URL] = {}
        # What the server says of itself at its root where its model listing is silent (the context
        # of proxy.backends.catalog.described_context), by engine kind, with when it was asked.
        self.described: dict[str, tuple[float, int | None]] = {}
        # The request extension every transport reads its timeouts from.
        self._timeouts = {"timeout": httpx.Timeout(timeout_s, connect=connect_timeout_s).as_dict()}
        if transport is None:
            limits = httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=keepalive_s,
            )
            transport = UpstreamTransport(limits)
        self.transport = transport

    def _url(self, path: str, root: bool) -> httpx.URL:
        # A handful of paths, each parsed once: httpx's URL parser is pure Python.
        key = (path, root)
        url = self._urls.get(key)
        if url is None:
            url = httpx.URL((self.root_url if root else self.base_url) + path)
            # Passed-through routes carry any path (and query) a client sends: not all are kept.
            if len(self._urls) < MAX_CACHED_URLS:
                self._urls[key] = url
        return url

    def auth_headers(self, client_authorization: str | None) -> dict[str, str]:
        """The upstream's own key when configured; else the client's, for transparent set-ups."""
        if self._api_key:
            return {"authorization": f"Bearer {self._api_key}"}
        if client_authorization:
            return {"authorization": client_authorization}
        return {}

    async def open(
        self,
        method: str,
        path: str,
        *,
        content: bytes | AsyncIterable[bytes] | None = None,
        headers: Mapping[str, str] | None = None,
        root: bool = False,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """Send a request and return the response with its body not yet read (streaming).

        Every request to this upstream is sent here, ``GET /models`` included; ``timeout_s``: one
        timeout for every phase instead of the upstream's own.

        The request is made with ``stream=``, so httpx adds no header of its own (``Host``,
        ``Content-Length`` or ``Transfer-Encoding``): the transport's HTTP client writes them from
        the URL and the body, as it must anyway (~20 us a request less than ``content=``)."""
        extensions = {"timeout": httpx.Timeout(timeout_s).as_dict()} if timeout_s is not None else self._timeouts
        body = httpx.ByteStream(content or b"") if content is None or isinstance(content, bytes) else _Streamed(content)
        request = httpx.Request(method, self._url(path, root), headers=headers, stream=body, extensions=extensions)
        if self._basic_auth is not None:
            request.headers["authorization"] = self._basic_auth
        try:
            return await self.transport.handle_async_request(request)
        except httpx.TimeoutException as exc:
            # Neither a connect nor a pool timeout ever sent the request: another backend may take it.
            if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
                raise UpstreamUnreachable(
                    "connect timeout" if isinstance(exc, httpx.ConnectTimeout) else "no free connection"
                ) from exc
            raise UpstreamTimeout() from exc
        except httpx.ConnectError as exc:
            raise UpstreamUnreachable(type(exc).__name__) from exc
        except httpx.TransportError as exc:
            # The connection broke after the request went out: the upstream may be computing it.
            raise UpstreamConnectionLost(type(exc).__name__) from exc

    read = staticmethod(read_response)

    async def get_models(
        self, headers: Mapping[str, str] | None = None, timeout_s: float = 3.0
    ) -> httpx.Response | None:
        """``GET /models`` with the given credentials (default: the proxy's own), body read; None when
        the upstream cannot be reached."""
        return (await self.models_or_why(headers, timeout_s))[0]

    async def models_or_why(
        self, headers: Mapping[str, str] | None = None, timeout_s: float = 3.0
    ) -> tuple[httpx.Response | None, str]:
        """:meth:`get_models`, and when it cannot be reached why not (a certificate the proxy does not
        trust is not "nothing answers")."""
        headers = headers if headers is not None else self.auth_headers(None)
        try:
            response = await self.open("GET", "/models", headers=headers, timeout_s=timeout_s)
        except UpstreamError as error:
            return None, unreachable_reason(error)
        try:
            await response.aread()  # ``response.content`` is the listing
        except httpx.HTTPError as error:
            return None, unreachable_reason(error)
        finally:
            await response.aclose()
        return response, ""

    async def probe_models(self, timeout_s: float = 3.0) -> list[dict[str, Any]] | None:
        """The models listed (``[]`` if the answer lists none), or None when the upstream is
        unreachable, answers 5xx, or answers 404 (nothing serves the API at its base URL, a wrong
        path: every request sent there would be answered 404 too)."""
        response = await self.get_models(timeout_s=timeout_s)
        if response is None or response.status_code >= 500 or response.status_code == 404:
            return None
        return model_list(response)

    async def ready(self) -> bool:
        return await self.probe_models() is not None

    async def alive(self, timeout_s: float = 3.0) -> bool:
        """Whether the engine itself answers: ``GET /health`` at the server root (vLLM checks its
        engine there, 503 when it is dead; llama-server answers 503 while loading), or where a
        server has no such route (404, 405), ``GET /models``. A wedged vLLM still lists its models,
        so the listing alone cannot say."""
        try:
            response = await self.open(
                "GET", "/health", headers=self.auth_headers(None), root=True, timeout_s=timeout_s
            )
        except UpstreamError:
            return False
        try:
            await response.aread()
        except httpx.HTTPError:
            return False
        finally:
            await response.aclose()
        if response.status_code in (404, 405):
            return await self.probe_models(timeout_s) is not None
        return response.status_code < 400

    async def aclose(self) -> None:
        await self.transport.aclose()


def upstream_error_kind(exc: UpstreamError) -> str:
    """The ``kind`` of ``prefix_proxy_upstream_errors_total`` an upstream error counts as."""
    if isinstance(exc, UpstreamProtocolError):
        return "invalid_response"
    if isinstance(exc, UpstreamTimeout):  # the request's own deadline included
        return "timeout"
    if isinstance(exc, UpstreamConnectionLost):  # after the request went out: the answer never came whole
        return "connection_lost"
    return "unreachable"


def credential_forms(api_key: str | None, url: httpx.URL) -> tuple[str, ...]:
    """The credentials an upstream with this key and URL is sent, as its answer may echo them: the
    key (``Bearer <key>`` contains it), and for a URL's ``user:password@`` the Basic token, the
    pair decoded and as the URL spells it, and the password alone."""
    forms: list[str] = list(key_forms(api_key))
    if url.userinfo:
        pair = f"{url.username}:{url.password}"
        forms += [base64.b64encode(pair.encode()).decode(), pair, url.userinfo.decode("ascii", "replace")]
        if len(url.password) >= MIN_REDACTED_PASSWORD:
            forms.append(url.password)
    return tuple(forms)


# A key shorter than this is a placeholder (vLLM's docs use "EMPTY", "token-abc123"), not worth
# hiding, and replacing it wherever it occurs would mangle the answer ("1" in "code": 401): only
# its Authorization form is scrubbed.
MIN_REDACTED_KEY = 12


def key_forms(api_key: str | None) -> tuple[str, ...]:
    """What of an API key the proxy sent an upstream answer may echo, to scrub."""
    if not api_key:
        return ()
    return (api_key,) if len(api_key) >= MIN_REDACTED_KEY else (f"Bearer {api_key}",)


class Redactor:
    """Replaces credentials with ``[redacted]`` in bytes an upstream sent: as they are, and as a
    JSON string escapes them. Longest first, so a pair is not half replaced by its password."""

    def __init__(self, credentials: Iterable[str]) -> None:
        forms: set[bytes] = set()
        for secret in credentials:
            for form in (secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]):
                forms.add(form.encode("utf-8", "surrogatepass"))
        forms.discard(b"")
        self._forms = sorted(forms, key=len, reverse=True)

    def __call__(self, raw: bytes) -> bytes:
        for form in self._forms:
            if form in raw:
                raw = raw.replace(form, REDACTED)
        return raw

    def stream(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        """``chunks`` redacted as they come. Only what could be the start of a credential, at the end
        of a chunk, waits for the next (a credential split across two chunks is found whole); the
        rest goes at once (an event's end is not held back from a client streaming it)."""
        return self._redacted(chunks)

    async def _redacted(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        pending = b""
        async for chunk in chunks:
            data = self(pending + chunk)
            held = self._unfinished(data)
            pending = data[len(data) - held :] if held else b""
            if len(data) > held:
                yield data[: len(data) - held]
        if pending:
            yield pending

    def _unfinished(self, data: bytes) -> int:
        """How many of ``data``'s last bytes begin a credential that does not end in it."""
        held = 0
        for form in self._forms:
            at = data.find(form[:1], max(0, len(data) - len(form) + 1))
            while at != -1 and len(data) - at > held:
                if form.startswith(data[at:]):
                    held = len(data) - at
                    break
                at = data.find(form[:1], at + 1)
        return held


def unreachable_reason(error: BaseException) -> str:
    """Why a backend could not be reached, in a few words: its certificate not trusted (with what
    the TLS library said), or nothing answering."""
    cause: BaseException | None = error
    handshake = ""
    while cause is not None:
        # aiohttp's certificate error is an SSLCertVerificationError too; ssl's own, below it, says why.
        if isinstance(cause, ssl.SSLCertVerificationError) and getattr(cause, "verify_message", None):
            return (
                f"its TLS certificate is not trusted ({cause.verify_message}): give the CA in SSL_CERT_FILE "
                "(a PEM file) or SSL_CERT_DIR"
            )
        if isinstance(cause, ssl.SSLError) and not handshake:
            handshake = f"the TLS handshake failed ({getattr(cause, 'reason', None) or cause})"
        cause = cause.__cause__ or cause.__context__
    return handshake
