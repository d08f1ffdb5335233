"""The backends one proxy forwards to: pick by policy, fail over, keep track of health.

With one backend the pool adds nothing to a request but a metrics increment. With several, a
request goes to the first backend its policy ranks that is not ejected and serves its model; when
that backend cannot be reached (or answers 502/503/504) the same bytes go to the next one, and the
backend is ejected for a while (passive health). A background check (``run_health_checks``)
re-admits backends that answer again and learns which models each one serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.backends.backend import Backend
from proxy.backends.echo import EchoedHeaders
from proxy.backends.keyheaders import KeyHeaders
from proxy.backends.policies import RoutingPolicy
from proxy.backends.transport import WholeBodyStream
from proxy.backends.upstream import model_list, read_response
from proxy.http.errors import ProxyError, upstream_unreachable
from proxy.observability.metrics import Metrics

logger = logging.getLogger("prefix_proxy.backends")

# Statuses that mean "this server cannot take the request now", not "the request is wrong".
FAILOVER_STATUSES = frozenset({502, 503, 504})
BACKEND_EXTENSION = "prefix_proxy_backend"


@dataclass
class ModelListing:
    # What the backends that answered 200 list together; None when none did.
    data: list[dict[str, Any]] | None = None
    # When none did: the first answer that refused the credentials (4xx), for the client.
    refusal: httpx.Response | None = None


class BackendPool:
    def __init__(
        self,
        backends: Sequence[Backend],
        policy: RoutingPolicy,
        metrics: Metrics | None = None,
        key_headers: Sequence[str] = (),
    ) -> None:
        if not backends:
            raise ValueError("a backend pool needs at least one backend")
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique: {names}")
        self.backends = list(backends)
        self.policy = policy
        self._metrics = metrics
        # For a router behind the proxy: the routing key travels as these headers, and what the
        # router asks to be sent back (llm-d's x-session-token) is echoed (set by echo_from).
        self._key_headers = KeyHeaders(key_headers)
        self._echo: EchoedHeaders | None = None
        if metrics is not None:
            metrics.watch_backends(self.backends)

    read = staticmethod(read_response)

    @property
    def single(self) -> bool:
        return len(self.backends) == 1

    def credentials(self, tenant_key: str | None, client_authorization: str | None = None) -> dict[str, str]:
        """How a request authenticates upstream (the one place that decides it): the tenant's own
        upstream key; else the upstream key configured for the proxy; else the client's credentials,
        passed on only when given (an open proxy) and sendable as a header at all."""
        if tenant_key:
            return {"authorization": f"Bearer {tenant_key}"}
        if client_authorization is not None and not client_authorization.isascii():
            client_authorization = None
        # Every backend is configured with the same upstream key.
        return self.backends[0].upstream.auth_headers(client_authorization)

    def rank(self, key: str | None = None, model: str | None = None) -> list[Backend]:
        """Backends in the order to try them: the policy's order among live backends serving ``model``,
        then ejected ones, soonest re-admitted first (better a retry than an outage)."""
        if self.single:
            return self.backends
        now = time.monotonic()
        candidates = [b for b in self.backends if b.serves(model)] or self.backends
        live = [b for b in candidates if b.available(now)]
        resting = sorted((b for b in candidates if not b.available(now)), key=lambda b: b.available_at)
        return (self.policy.rank(live, key) if live else []) + resting

    async def open(
        self,
        method: str,
        path: str,
        *,
        content: bytes | AsyncIterable[bytes] | None = None,
        headers: Mapping[str, str] | None = None,
        root: bool = False,
        key: str | None = None,
        model: str | None = None,
        pinned_to: str | None = None,
        replayable: bool = True,
    ) -> httpx.Response:
        """Send to the best backend for ``key``/``model``; the response's body is not yet read.

        The backend that answered is in ``response.extensions["prefix_proxy_backend"]``. Only a
        request that never left (connection refused, connect or pool timeout) is retried elsewhere:
        after a timeout or a connection dropped after sending, the backend may still be computing,
        and a second one would double the work.

        ``pinned_to`` names the only backend that can answer (it holds state the request refers to,
        such as a stored response); ``replayable=False``: the body is a stream that can be sent
        once, so there is no second try.
        """
        pinned = [b for b in self.backends if b.name == pinned_to] if pinned_to is not None else []
        ranked = pinned or self.rank(key, model)
        if not replayable:
            ranked = ranked[:1]
        last_error: ProxyError | None = None
        for attempt, backend in enumerate(ranked):
            is_last = attempt == len(ranked) - 1
            backend.in_flight += 1
            try:
                outgoing = await self._outgoing(headers, key)
                response = await backend.upstream.open(method, path, content=content, headers=outgoing, root=root)
            except ProxyError as error:
                backend.in_flight -= 1
                timed_out = error.status == 504
                self._count(backend, "timeout" if timed_out else "unreachable")
                if error.code != "upstream_unreachable":
                    # The request left (a timeout, or a connection dropped after sending): the
                    # backend may be computing it, and sending it again would do the work twice.
                    if not timed_out and not self.single:
                        backend.record_failure()
                    raise
                self._failed(backend, f"unreachable ({error.message})", moving_on=not is_last)
                last_error = error
                continue
            except BaseException:  # cancelled (the client left): the slot must not leak
                backend.in_flight -= 1
                raise
            if response.status_code in FAILOVER_STATUSES:
                self._count(backend, "http_5xx")
                if not is_last:
                    backend.in_flight -= 1
                    self._failed(backend, f"answered {response.status_code}", moving_on=True)
                    await response.aclose()
                    continue
                if not self.single:
                    backend.record_failure()
            else:
                self._count(backend, "ok")
                backend.record_success()
                if self._echo is not None:
                    self._echo.observe(key, outgoing, response.headers)
            response.extensions[BACKEND_EXTENSION] = backend.name
            if response.is_closed:  # a transport that hands back a body already read (httpx.MockTransport)
                backend.in_flight -= 1
            else:
                response.stream = _ReleaseOnClose(response.stream, backend)
            return response
        raise last_error or upstream_unreachable("no backend")

    def echo_from(self, echo: EchoedHeaders) -> None:
        """Echo the router's response headers on later requests with the same key."""
        self._echo = echo

    async def _outgoing(self, headers: Mapping[str, str] | None, key: str | None) -> Mapping[str, str] | None:
        headers = self._key_headers.apply(headers, key)
        return await self._echo.add_to(headers, key) if self._echo is not None else headers

    def _failed(self, backend: Backend, why: str, *, moving_on: bool) -> None:
        backend.record_failure()
        if moving_on:
            logger.warning("backend %s %s; trying the next one", backend.name, why)
            if self._metrics is not None:
                self._metrics.backend_failovers.labels(backend.name).inc()

    def _count(self, backend: Backend, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.backend_requests.labels(backend.name, outcome).inc()

    # -- models and health ------------------------------------------------------------------------

    async def list_models(self, headers: Mapping[str, str] | None = None) -> ModelListing:
        """Every model the live backends list to these credentials (default: the proxy's own), the
        first listing of each id kept."""
        backends = [b for b in self.backends if b.available()] or self.backends
        answers = await asyncio.gather(*(b.upstream.get_models(headers) for b in backends))
        merged: dict[str, dict[str, Any]] = {}
        listing = ModelListing()
        answered = False
        for backend, answer in zip(backends, answers, strict=True):
            if answer is None or answer.status_code >= 500:
                continue
            if answer.status_code != 200:
                listing.refusal = listing.refusal or answer
                continue
            answered = True
            models = model_list(answer)
            if headers is None:  # a tenant's credentials may see fewer models than the backend serves
                self._learned(backend, models)
            for model in models:
                merged.setdefault(str(model.get("id")), model)
        if answered:
            listing.data = list(merged.values())
        return listing

    async def backends_answering(self) -> dict[str, bool]:
        results = await asyncio.gather(*(b.upstream.ready() for b in self.backends))
        return {b.name: ok for b, ok in zip(self.backends, results, strict=True)}

    async def ready(self) -> bool:
        """At least one backend answers."""
        return any((await self.backends_answering()).values())

    async def check_health(self, timeout_s: float = 3.0, hold_s: float = 0.0) -> None:
        """One round of active checks: ``GET /models`` on every backend. A backend that fails stays
        ejected for at least ``hold_s`` (until the next round can re-admit it)."""
        listings = await asyncio.gather(*(b.upstream.probe_models(timeout_s) for b in self.backends))
        for backend, listing in zip(self.backends, listings, strict=True):
            if listing is None:
                if backend.available():
                    logger.warning("backend %s failed its health check; ejected", backend.name)
                backend.check_failed(hold_s)
            else:
                was_out = backend.check_failed_until > 0
                backend.check_passed()
                if was_out and backend.available():
                    logger.info("backend %s answers again; re-admitted", backend.name)
                self._learned(backend, listing)

    async def run_health_checks(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                timeout_s = min(3.0, interval_s)
                await self.check_health(timeout_s, hold_s=interval_s + timeout_s)
            except Exception:  # the checker must outlive any one bad round
                logger.exception("backend health check failed")

    @staticmethod
    def _learned(backend: Backend, listing: list[dict[str, Any]]) -> None:
        ids = frozenset(str(m["id"]) for m in listing if m.get("id") is not None)
        # An empty or id-less listing says nothing about which models are served.
        backend.models = ids or None

    async def aclose(self) -> None:
        await asyncio.gather(*(b.upstream.aclose() for b in self.backends))


class _ReleaseOnClose(WholeBodyStream):
    """A response body that gives the backend's in-flight slot back when it is closed."""

    def __init__(self, inner: httpx.AsyncByteStream | httpx.SyncByteStream, backend: Backend) -> None:
        self._inner = inner
        self._backend: Backend | None = backend

    async def __aiter__(self) -> AsyncIterator[bytes]:
        assert isinstance(self._inner, httpx.AsyncByteStream)
        async for chunk in self._inner:
            yield chunk

    async def read_all(self) -> bytes:
        if isinstance(self._inner, WholeBodyStream):
            return await self._inner.read_all()
        return await super().read_all()

    async def aclose(self) -> None:
        if self._backend is not None:
            self._backend.in_flight -= 1
            self._backend = None
        if isinstance(self._inner, httpx.AsyncByteStream):
            await self._inner.aclose()
