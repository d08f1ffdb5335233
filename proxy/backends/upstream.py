"""The upstream OpenAI-compatible server (vLLM, or anything that speaks its API).

One pooled ``httpx.AsyncClient`` per upstream; transport failures become
OpenAI-shaped 502/504 errors so no client ever sees a stack trace.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterable, Iterable, Mapping
from typing import Any

import httpx

from proxy.backends.transport import ProxyAiohttpTransport, WholeBodyStream
from proxy.http.errors import (
    UpstreamConnectionLost,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from proxy.openai.jsonio import loads

MAX_CACHED_URLS = 256
# What stands in an upstream's answer for a credential the proxy sent it.
REDACTED = b"[redacted]"
# A URL's password alone is redacted from this length on (a shorter one would blank out words).
MIN_REDACTED_PASSWORD = 4


class _NoCookies(httpx.Cookies):
    def extract_cookies(self, response: httpx.Response) -> None:
        return None

    def set_cookie_header(self, request: httpx.Request) -> None:
        return None


async def read_response(response: httpx.Response) -> bytes:
    """Read a response body, mapping a mid-body timeout or drop to :class:`UpstreamTimeout` (504) or
    :class:`UpstreamConnectionLost` (502)."""
    try:
        stream = response.stream
        if isinstance(stream, WholeBodyStream) and "content-encoding" not in response.headers:
            return await stream.read_all()  # no decoding to do: one read from the transport
        return await response.aread()
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout() from exc
    except httpx.TransportError as exc:
        raise UpstreamConnectionLost(type(exc).__name__) from exc
    finally:
        await response.aclose()


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
        url = httpx.URL(base_url)
        # Credentials in the URL (http://user:pw@host/v1) are sent as HTTP Basic auth, as httpx does
        # itself; the URL used for requests carries none (aiohttp refuses a URL with credentials
        # next to an Authorization header, and a URL is easier to leak than a header).
        auth = httpx.BasicAuth(url.username, url.password) if url.userinfo else None
        # Every form in which this upstream's own credentials leave the proxy, to be scrubbed from
        # what it answers (an error page that echoes the request's headers): see :class:`Redactor`.
        self.credentials = credential_forms(api_key, url)
        if url.userinfo:
            base_url = str(url.copy_with(userinfo=b""))
        self.base_url = base_url.rstrip("/")
        # vLLM serves /tokenize, /health and /metrics at the server root, not under /v1.
        self.root_url = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self._api_key = api_key
        self._urls: dict[tuple[str, bool], httpx.URL] = {}
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=keepalive_s
        )
        # Requests with a whole body go straight to aiohttp (ProxyAiohttpTransport.send_bytes) unless
        # the client has something to add (Basic auth from the URL).
        self._direct: ProxyAiohttpTransport | None = None
        if transport is None and use_aiohttp:
            # Same httpx client API, aiohttp's connection handling underneath: measured 2 ms less
            # per proxied request than httpx's own transport (bench/overhead.py).
            transport = ProxyAiohttpTransport(limits=limits, trust_env=False)
            self._direct = transport if auth is None else None
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=self._timeout, limits=limits, transport=transport, auth=auth)
        # One client serves every tenant: a cookie the upstream sets for one must never ride along
        # on another's request. httpx has no switch for its jar, so it gets one that keeps nothing
        # (which also saves parsing every response for cookies: ~80 us per request).
        self.client._cookies = _NoCookies()

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
    ) -> httpx.Response:
        """Send a request and return the response with its body not yet read (streaming)."""
        url = self._url(path, root)
        try:
            if self._direct is not None and not isinstance(content, AsyncIterable):
                return await self._direct.send_bytes(method, str(url), content, headers or {}, self._timeout)
            request = self.client.build_request(method, url, content=content, headers=headers)
            return await self.client.send(request, stream=True)
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
        try:
            return await self.client.get(
                self.base_url + "/models",
                headers=headers if headers is not None else self.auth_headers(None),
                timeout=timeout_s,
            )
        except httpx.HTTPError:
            return None

    async def probe_models(self, timeout_s: float = 3.0) -> list[dict[str, Any]] | None:
        """The models listed (``[]`` if the answer lists none), or None when the upstream is
        unreachable or answers 5xx."""
        response = await self.get_models(timeout_s=timeout_s)
        if response is None or response.status_code >= 500:
            return None
        return model_list(response)

    async def ready(self) -> bool:
        return await self.probe_models() is not None

    async def aclose(self) -> None:
        await self.client.aclose()


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
