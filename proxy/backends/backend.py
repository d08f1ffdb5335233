"""One upstream server and what the proxy knows of its health and load.

Passive health is outlier detection as Envoy does it: requests a backend fails (it cannot be
reached, or answers 5xx or 429) count against it; enough of them, or one that says so plainly
(502/503/504, a ``Retry-After``), eject it for a while. When the while is over the backend is
*half-open*: its next request is a trial, and only a trial that succeeds puts it back in service
(``GET /models`` answers 200 on a wedged engine, so a health check cannot vouch for it).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING

import xxhash

from proxy.backends.upstream import Upstream
from proxy.config import backend_name as backend_name  # what metrics call a backend, read as settings load

if TYPE_CHECKING:
    from proxy.config import RoutingSettings

# Why a backend was ejected (the ``reason`` of prefix_proxy_backend_ejections_total).
UNREACHABLE = "unreachable"  # the request never left: refused, connect or pool timeout
CONNECTION_LOST = "connection_lost"  # the backend dropped the connection after it got the request
UNAVAILABLE = "unavailable"  # it answered 502, 503 or 504: it cannot take requests now
RETRY_AFTER = "retry_after"  # it answered 429 or 503 with a Retry-After: out for as long as it asked
ERRORS = "errors"  # it answered 5xx or 429 to consecutive_failures requests in a row
# Its answer was not the protocol (a 200 that is no answer, a stream that ended before its first
# event or mid-way), or no first token came within ``first_token_timeout_s`` and it did not answer
# a health check either: failures however it labelled them (``proxy.routes.exchange``).
INVALID_ANSWER = "invalid_answer"
STREAM_CUT = "stream_cut"
NO_FIRST_TOKEN = "no_first_token"
EJECTION_REASONS = (
    UNREACHABLE,
    CONNECTION_LOST,
    UNAVAILABLE,
    RETRY_AFTER,
    ERRORS,
    INVALID_ANSWER,
    STREAM_CUT,
    NO_FIRST_TOKEN,
)

# Kept so that 2.0 ** exponent never overflows a float, whatever the count of ejections.
_MAX_DOUBLINGS = 32
_DELAY_SECONDS = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class OutlierDetection:
    """When failed requests take a backend out of rotation, for how long, and how many times a
    request the backend answered with a failure is tried elsewhere (docs/routing.md)."""

    # Answers of 5xx or 429 in a row that eject a backend. Failing fast, a wedged engine gets there
    # within milliseconds under load; a few keep one request that fails everywhere (retried by its
    # client) from ejecting healthy backends.
    consecutive_failures: int = 3
    # An ejection lasts base_ejection_s, doubling with each recent ejection, up to max_ejection_s.
    base_ejection_s: float = 1.0
    max_ejection_s: float = 30.0
    # A Retry-After ejects for as long as it asks, up to this (0: Retry-After is not honoured).
    max_retry_after_s: float = 60.0
    # Other backends a request is sent to after one answered it with 5xx or 429.
    max_retries: int = 2
    # A first token later than this: the backend is checked; 0: never (``proxy.routes.exchange``).
    first_token_timeout_s: float = 30.0

    @classmethod
    def from_settings(cls, routing: RoutingSettings) -> OutlierDetection:
        return cls(
            consecutive_failures=routing.consecutive_failures,
            base_ejection_s=routing.base_ejection_s,
            max_ejection_s=routing.max_ejection_s,
            max_retry_after_s=routing.max_retry_after_s,
            max_retries=routing.max_retries,
            first_token_timeout_s=routing.first_token_timeout_s,
        )

    def ejection_s(self, ejections: int) -> float:
        """How long the ``ejections``-th recent ejection lasts."""
        return min(self.max_ejection_s, self.base_ejection_s * 2.0 ** min(ejections - 1, _MAX_DOUBLINGS))

    def retry_after_s(self, header: str | None, now: float | None = None) -> float | None:
        """The seconds a ``Retry-After`` asks for (delay-seconds or an HTTP-date), capped; None
        when it is absent, unreadable, already past, or not honoured."""
        if not header or self.max_retry_after_s <= 0:
            return None
        header = header.strip()
        if _DELAY_SECONDS.fullmatch(header):
            seconds = float(header)
        else:
            try:
                when = parsedate_to_datetime(header)
            except (TypeError, ValueError, IndexError):
                return None
            if when.tzinfo is None:  # an HTTP-date is GMT; a date without a zone is read as such
                when = when.replace(tzinfo=UTC)
            wall = time.time() if now is None else now
            seconds = when.timestamp() - wall
        if not math.isfinite(seconds) or seconds <= 0:
            return None
        return min(seconds, self.max_retry_after_s)


DEFAULT_OUTLIER_DETECTION = OutlierDetection()


@dataclass(eq=False)
class Backend:
    name: str
    upstream: Upstream
    in_flight: int = 0
    # Requests it failed (unreachable, 5xx, 429) since its last success.
    consecutive_failures: int = 0
    # Skipped until then after failed requests (passive; backs off) ...
    ejected_until: float = 0.0
    # ... or after a failed health check (active; lifted by the next check that passes).
    check_failed_until: float = 0.0
    # Why the passive ejection (one of EJECTION_REASONS); None while in service. Past
    # ejected_until the backend is half-open: its next request is a trial.
    ejected_for: str | None = None
    # Ejections since it last stayed in service for max_ejection_s: each one lasts longer.
    ejections: int = 0
    # Its trial request is in flight: no other request is sent to it until that one ends.
    on_trial: bool = False
    # When a success last ended an ejection.
    readmitted_at: float = 0.0
    # Models the backend listed at its last health check; None until one succeeded.
    models: frozenset[str] | None = None
    # The pool's rules (BackendPool sets its own).
    outliers: OutlierDetection = field(default=DEFAULT_OUTLIER_DETECTION, repr=False)
    # Seeds this backend's rendezvous scores (stable across replicas and restarts).
    seed: int = field(init=False)

    def __post_init__(self) -> None:
        self.seed = xxhash.xxh32_intdigest(self.name.encode())

    @property
    def available_at(self) -> float:
        return max(self.ejected_until, self.check_failed_until)

    def available(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.available_at and not self.on_trial

    def serves(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models

    def record_success(self, now: float | None = None) -> None:
        """It answered: back in service, its failures forgotten."""
        if self.ejected_for is not None:
            self.readmitted_at = time.monotonic() if now is None else now
        self.consecutive_failures = 0
        self.ejected_until = self.check_failed_until = 0.0
        self.ejected_for = None
        self.on_trial = False

    def check_failed(self, hold_s: float, now: float | None = None) -> None:
        self.check_failed_until = (time.monotonic() if now is None else now) + hold_s

    def check_passed(self) -> bool:
        """A passing health check lifts its own ejection, and one for being unreachable (the check
        reached it); whether it re-admitted the backend from the latter. A backend ejected for its
        answers (5xx, 429) keeps its pause and its trial: it lists its models all the same."""
        self.check_failed_until = 0.0
        if self.ejected_for == UNREACHABLE:
            self.record_success()
            return True
        return False

    def start_trial(self, now: float) -> bool:
        """Whether a request sent now is the ejected backend's trial (its ejection is over and no
        other trial is running); marks it so. Called only while ``ejected_for`` is set."""
        if self.on_trial or now < self.ejected_until:
            return False
        self.on_trial = True
        return True

    def end_trial(self) -> None:
        """The trial ended without a verdict (the client left): the next request is the trial."""
        self.on_trial = False

    def failed(self, *, trial: bool, at_once: bool) -> bool:
        """Count a request it failed; whether that calls for an ejection: a failed trial, a failure
        that says so plainly (``at_once``), or ``consecutive_failures`` in a row. A backend already
        out (it was ejected while this request was in flight, or every backend is out) is not
        ejected again: one outage must not escalate once per request it had in flight."""
        self.consecutive_failures += 1
        if trial:
            return True
        if self.ejected_for is not None:
            return False
        return at_once or self.consecutive_failures >= self.outliers.consecutive_failures

    def eject(self, reason: str, now: float, seconds: float | None = None) -> float:
        """Out of rotation for ``seconds`` (default: the backoff of its recent ejections); returns
        how long."""
        if self.ejected_for is None and now - self.readmitted_at > self.outliers.max_ejection_s:
            self.ejections = 0  # it served a good while since its last ejection: start over
        self.ejections += 1
        length = self.outliers.ejection_s(self.ejections) if seconds is None else seconds
        self.ejected_until = now + length
        self.ejected_for = reason
        self.on_trial = False
        return length

    def spare(self) -> None:
        """Not ejected after all (no other backend could take its requests): a failed trial puts
        it back in service rather than half-open forever; its failures stay counted."""
        if self.on_trial:
            self.on_trial = False
            self.ejected_for = None
            self.ejected_until = 0.0

    def record_failure(self, now: float | None = None, reason: str = UNAVAILABLE) -> None:
        """A request it failed in a way that ejects at once (the backoff of its recent ejections)."""
        now = time.monotonic() if now is None else now
        if self.failed(trial=self.on_trial, at_once=True):
            self.eject(reason, now)
