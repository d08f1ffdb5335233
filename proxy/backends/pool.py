"""The backends one proxy forwards to: pick by policy, fail over, keep track of health.

With one backend the pool adds nothing to a request but a metrics increment: its answer, whatever
it is, is the client's. With several, a request goes to the first backend its policy ranks that is
not ejected and serves its model. When that backend cannot be reached, the same bytes go to the
next one; when it answers 5xx or 429 before anything reached the client, they go to the next one
in service (up to ``max_retries`` times). Failures count against the backend (outlier detection,
:mod:`proxy.backends.backend`): enough of them eject it, and only a trial request that succeeds
brings it back. A background check (``run_health_checks``) re-admits backends that were
unreachable and answer again, and learns which models each one serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.backends.backend import (
    CONNECTION_LOST,
    EJECTION_REASONS,
    ERRORS,
    RETRY_AFTER,
    UNAVAILABLE,
    UNREACHABLE,
    Backend,
    OutlierDetection,
)
from proxy.backends.echo import EchoedHeaders
from proxy.backends.keyheaders import KeyHeaders
from proxy.backends.policies import RoutingPolicy
from proxy.backends.upstream import model_list, read_response
from proxy.http import ProxyError, UpstreamTimeout, UpstreamUnreachable
from proxy.observability import Metrics

logger = logging.getLogger("prefix_proxy.backends")

# Answers that mean "this server cannot take requests now": the backend is ejected at once.
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
# Answers whose Retry-After says for how long.
RETRY_AFTER_STATUSES = frozenset({429, 503})
# 5xx that say what the server does not implement (a route, an HTTP version), not that it failed:
# relayed like a 4xx, never held against the backend.
NOT_FAILURES = frozenset({501, 505})
BACKEND_EXTENSION = "prefix_proxy_backend"
# How long an active health check waits for a backend's model listing: at least, and at most.
CHECK_TIMEOUT_S = 1.0
MAX_CHECK_TIMEOUT_S = 3.0
# Set on a response that is its ejected backend's trial (what proves it again, or not).
TRIAL_EXTENSION = "prefix_proxy_trial"


def backend_failed(status: int) -> bool:
    """An answer that is the backend's failure, not the request's: any 5xx (but 501, 505) or 429.
    Another backend may answer the same request; a 4xx would be the same everywhere."""
    return status == 429 or (500 <= status < 600 and status not in NOT_FAILURES)


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
        outliers: OutlierDetection | None = None,
    ) -> None:
        if not backends:
            raise ValueError("a backend pool needs at least one backend")
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique: {names}")
        self.backends = list(backends)
        self.policy = policy
        self._metrics = metrics
        self.outliers = outliers or OutlierDetection()
        for backend in self.backends:
            backend.outliers = self.outliers
        # For a router behind the proxy: the routing key travels as these headers, and what the
        # router asks to be sent back (llm-d's x-session-token) is echoed (set by echo_from).
        self._key_headers = KeyHeaders(key_headers)
        self._echo: EchoedHeaders | None = None
        if metrics is not None:
            metrics.watch_backends(self.backends)
            for backend in self.backends:
                for reason in EJECTION_REASONS:
                    metrics.backend_ejections.labels(backend.name, reason)

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
        exclude: Collection[str] = (),
        attempted: list[str] | None = None,
    ) -> httpx.Response:
        """Send to the best backend for ``key``/``model``; the response's body is not yet read.

        The backend that answered is in ``response.extensions["prefix_proxy_backend"]``. A request
        that never left (connection refused, connect or pool timeout) goes to the next backend; one
        answered with 5xx or 429 goes to the next backend in service, at most ``max_retries``
        times, and the last answer is the client's when none is left. After a read timeout or a
        connection dropped after sending, the backend may still be computing, and a second one
        would double the work: no retry. Retries happen before anything reached the client, within
        the caller's deadline (the caller's ``asyncio.timeout`` around this call).

        ``pinned_to`` names the only backend that can answer (it holds state the request refers to,
        such as a stored response); ``replayable=False``: the body is a stream that can be sent
        once, so there is no second try. ``exclude``: backends whose answer to this request the
        caller found unusable (:meth:`retry_possible`, :meth:`answer_unusable`); ``attempted``: each
        backend the request is sent to is appended as it is sent (the caller's view while it waits).
        """
        pinned = [b for b in self.backends if b.name == pinned_to] if pinned_to is not None else []
        ranked = pinned or self.rank(key, model)
        if exclude:
            ranked = [b for b in ranked if b.name not in exclude] or ranked
        retries = self.outliers.max_retries
        if not replayable:
            ranked, retries = ranked[:1], 0
        last_error: UpstreamUnreachable | None = None
        # The previous backend's failed answer, closed only once this attempt has its backend (and
        # trial): chosen and claimed with no await between, so no other request takes the trial.
        discarded: httpx.Response | None = None
        # Backends that answered this request with a failure, counted against them only once
        # another backend answers it: (backend, status, Retry-After, on trial).
        failed: list[tuple[Backend, int, str | None, bool]] = []
        index = 0
        while True:
            backend = ranked[index]
            is_last = index == len(ranked) - 1
            # Sent while ejected: its trial (once the ejection is over), or every backend is out.
            probing = backend.ejected_for is not None
            trial = probing and backend.start_trial(time.monotonic())
            backend.in_flight += 1
            if attempted is not None:
                attempted.append(backend.name)
            try:
                if discarded is not None:
                    await discarded.aclose()
                    discarded = None
                outgoing = await self._outgoing(headers, key)
                response = await backend.upstream.open(method, path, content=content, headers=outgoing, root=root)
            except ProxyError as error:
                backend.in_flight -= 1
                timed_out = isinstance(error, UpstreamTimeout)
                self._count(backend, "timeout" if timed_out else "unreachable")
                if not isinstance(error, UpstreamUnreachable):
                    # The request left (a timeout, or a connection dropped after sending): the
                    # backend may be computing it, and sending it again would do the work twice.
                    # A timeout counts against a backend only as its trial (it did not prove itself).
                    if not self.single and not timed_out:
                        self._request_failed(backend, CONNECTION_LOST, model, trial)
                    elif trial:
                        self._request_failed(backend, backend.ejected_for or ERRORS, model, trial)
                    raise
                if not self.single:
                    self._request_failed(backend, UNREACHABLE, model, trial)
                last_error = error
                if is_last:
                    break
                self._moved_off(backend, f"unreachable ({error.message})")
                index += 1
                continue
            except BaseException:  # cancelled (the client left): the slot (and the trial) must not leak
                backend.in_flight -= 1
                if trial:
                    backend.end_trial()
                raise
            status = response.status_code
            if status >= 429 and backend_failed(status):  # one comparison for every good answer
                self._count(backend, "http_429" if status == 429 else "http_5xx")
                if not self.single:
                    following = self._next_in_service(ranked, index + 1) if retries else None
                    retry_after = response.headers.get("retry-after")
                    explicit = retry_after is not None and status in RETRY_AFTER_STATUSES
                    if explicit:
                        # The backend's own word about itself (come back later): taken at once.
                        self._answer_failed(backend, status, retry_after, model, trial)
                    elif following is not None:
                        failed.append((backend, status, retry_after, trial))
                    if following is not None:
                        retries -= 1
                        backend.in_flight -= 1
                        self._moved_off(backend, f"answered {status}")
                        discarded, index = response, following
                        continue
                    if failed:
                        # Failed on every backend it was tried on: more likely the request's doing
                        # (an input that makes the engine fail) than all of theirs, and no tenant
                        # may eject backends for everyone by sending it. Trials stay undecided.
                        for earlier, _, _, on_trial in failed:
                            if on_trial:
                                earlier.end_trial()
                        if trial and not explicit:
                            backend.end_trial()
                    elif not explicit:
                        self._answer_failed(backend, status, retry_after, model, trial)
            else:
                self._count(backend, "ok")
                # Another backend answered what these failed: the failures were theirs.
                for earlier, earlier_status, retry_after, on_trial in failed:
                    self._answer_failed(earlier, earlier_status, retry_after, model, on_trial)
                if probing or backend.consecutive_failures:
                    self._answered(backend, status, probing, trial)
                if self._echo is not None:
                    self._echo.observe(key, outgoing, response.headers)
            response.extensions[BACKEND_EXTENSION] = backend.name
            if trial:
                response.extensions[TRIAL_EXTENSION] = True
            if response.is_closed:  # a transport that hands back a body already read (httpx.MockTransport)
                backend.in_flight -= 1
            else:
                response.stream = _ReleaseOnClose(response.stream, backend)
            return response
        raise last_error or UpstreamUnreachable("no backend")

    # -- answers found unusable after they came (proxy.routes.exchange) ---------------------------

    def retry_possible(self, tried: Collection[str], key: str | None, model: str | None) -> bool:
        """Whether a backend other than ``tried`` is in service for ``model`` (a request whose answer
        was unusable goes there, while nothing of it reached the client)."""
        if self.single:
            return False
        now = time.monotonic()
        return any(b.name not in tried and b.serves(model) and b.available(now) for b in self.rank(key, model))

    def answer_unusable(self, name: str | None, reason: str, model: str | None) -> None:
        """Count against backend ``name`` an answer that came but was unusable (``reason``: one of
        ``INVALID_ANSWER``, ``STREAM_CUT``, ``NO_FIRST_TOKEN``), and eject it at once: a server that
        answers outside its protocol, breaks its streams or stops answering is in no state to serve
        (one pool: nothing to eject it in favour of)."""
        backend = next((b for b in self.backends if b.name == name), None)
        if backend is None:
            return
        if not self.single:
            self._request_failed(backend, reason, model, backend.on_trial)

    def probe_alive(self, name: str | None) -> Awaitable[bool]:
        """Whether backend ``name``'s engine still answers a health check (:meth:`Upstream.alive`)."""
        backend = next((b for b in self.backends if b.name == name), None)
        if backend is None:
            return _answered_true()
        return backend.upstream.alive()

    def echo_from(self, echo: EchoedHeaders) -> None:
        """Echo the router's response headers on later requests with the same key."""
        self._echo = echo

    async def _outgoing(self, headers: Mapping[str, str] | None, key: str | None) -> Mapping[str, str] | None:
        headers = self._key_headers.apply(headers, key)
        return await self._echo.add_to(headers, key) if self._echo is not None else headers

    @staticmethod
    def _next_in_service(ranked: Sequence[Backend], start: int) -> int | None:
        """The next backend to retry an answered request on: one in service now (or half-open, its
        trial free); an ejected backend would most likely answer the same."""
        now = time.monotonic()
        for index in range(start, len(ranked)):
            if ranked[index].available(now):
                return index
        return None

    def _answered(self, backend: Backend, status: int, probing: bool, trial: bool) -> None:
        """An answer that is not the backend's failure, from a backend with failures or ejected."""
        if status >= 400:
            # The request's fault: says nothing of the backend's health either way (a wedged vLLM
            # still validates requests in its API server), so a run of 500s goes on counting.
            if trial:
                backend.end_trial()
            return
        if not probing:
            # Sent while it was in service: ends its run of failures, not an ejection that began
            # while this request was in flight.
            backend.consecutive_failures = 0
            return
        reason = backend.ejected_for
        backend.record_success()
        logger.info("backend %s answered again (ejected: %s); re-admitted", backend.name, reason)

    def _answer_failed(
        self, backend: Backend, status: int, retry_after: str | None, model: str | None, trial: bool
    ) -> None:
        wait = self.outliers.retry_after_s(retry_after) if status in RETRY_AFTER_STATUSES else None
        reason = RETRY_AFTER if wait is not None else UNAVAILABLE if status in UNAVAILABLE_STATUSES else ERRORS
        if backend.failed(trial=trial, at_once=reason != ERRORS):
            self._eject(backend, reason, model, wait, spare_last=True, why=f"answered {status}")

    def _request_failed(self, backend: Backend, reason: str, model: str | None, trial: bool) -> None:
        # A backend that cannot be reached (or drops connections) serves nobody: ejected even when
        # it is the last (every backend is still tried when all are out).
        if backend.failed(trial=trial, at_once=True):
            self._eject(backend, reason, model, None, spare_last=False, why=reason.replace("_", " "))

    def _eject(
        self, backend: Backend, reason: str, model: str | None, seconds: float | None, *, spare_last: bool, why: str
    ) -> None:
        now = time.monotonic()
        if spare_last and not any(b is not backend and b.serves(model) and b.available(now) for b in self.backends):
            # The last backend in service for this model: ejecting it would send its requests to
            # backends that are out for a reason, and its own answer is what the client gets anyway.
            backend.spare()
            return
        was_trial = backend.on_trial
        length = backend.eject(reason, now, seconds)
        logger.warning(
            "backend %s %s%s; ejected for %.1f s (%s, ejection %d)",
            backend.name,
            why,
            " on its trial" if was_trial else "",
            length,
            reason,
            backend.ejections,
        )
        if self._metrics is not None:
            self._metrics.backend_ejections.labels(backend.name, reason).inc()

    def _moved_off(self, backend: Backend, why: str) -> None:
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
                # Lifts its own ejection and one for being unreachable, never one for answering
                # 5xx/429 (a wedged engine lists its models all the same): that takes a trial.
                readmitted = backend.check_passed()
                if (was_out or readmitted) and backend.available():
                    logger.info("backend %s answers again; re-admitted", backend.name)
                self._learned(backend, listing)

    async def run_health_checks(self, interval_s: float, first_round: asyncio.Event | None = None) -> None:
        """A round of checks at once (a backend down or at a wrong path is out before the first
        requests reach it; ``first_round`` is set when it is over), then every ``interval_s``."""
        while True:
            try:
                # At least CHECK_TIMEOUT_S for an answer whatever the interval: a backend that answers
                # in time must not fail its check (and be ejected) for a round trip longer than a short
                # interval; rounds run one after another, so a long wait delays the next round only.
                timeout_s = min(MAX_CHECK_TIMEOUT_S, max(CHECK_TIMEOUT_S, interval_s))
                await self.check_health(timeout_s, hold_s=interval_s + timeout_s)
            except Exception:  # the checker must outlive any one bad round
                logger.exception("backend health check failed")
            if first_round is not None:
                first_round.set()
                first_round = None
            await asyncio.sleep(interval_s)

    @staticmethod
    def _learned(backend: Backend, listing: list[dict[str, Any]]) -> None:
        ids = frozenset(str(m["id"]) for m in listing if m.get("id") is not None)
        # An empty or id-less listing says nothing about which models are served.
        backend.models = ids or None

    async def aclose(self) -> None:
        await asyncio.gather(*(b.upstream.aclose() for b in self.backends))


async def _answered_true() -> bool:
    return True


class _ReleaseOnClose(httpx.AsyncByteStream):
    """A response body that gives the backend's in-flight slot back when it is closed."""

    def __init__(self, inner: httpx.AsyncByteStream | httpx.SyncByteStream, backend: Backend) -> None:
        self._inner = inner
        self._backend: Backend | None = backend

    async def __aiter__(self) -> AsyncIterator[bytes]:
        assert isinstance(self._inner, httpx.AsyncByteStream)
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        if self._backend is not None:
            self._backend.in_flight -= 1
            self._backend = None
        if isinstance(self._inner, httpx.AsyncByteStream):
            await self._inner.aclose()
