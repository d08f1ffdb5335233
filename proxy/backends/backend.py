"""One upstream server and what the proxy knows of its health and load."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import xxhash

from proxy.backends.upstream import Upstream

# Passive ejection: a backend that failed is skipped for BASE * 2**(failures - 1) seconds, up to MAX.
EJECT_BASE_S = 1.0
EJECT_MAX_S = 30.0


def backend_name(base_url: str) -> str:
    """``host:port`` (and a path other than ``/v1``): what metrics and logs call a backend.

    Never the URL itself, which may carry credentials.
    """
    parts = urlsplit(base_url)
    host = parts.hostname or "upstream"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = parts.path.rstrip("/")
    return f"{host}:{port}" + (path if path and path != "/v1" else "")


@dataclass(eq=False)
class Backend:
    name: str
    upstream: Upstream
    in_flight: int = 0
    consecutive_failures: int = 0
    # Skipped until then after failed requests (passive; backs off) ...
    ejected_until: float = 0.0
    # ... or after a failed health check (active; lifted by the next check that passes).
    check_failed_until: float = 0.0
    # Models the backend listed at its last health check; None until one succeeded.
    models: frozenset[str] | None = None
    # Seeds this backend's rendezvous scores (stable across replicas and restarts).
    seed: int = field(init=False)

    def __post_init__(self) -> None:
        self.seed = xxhash.xxh32_intdigest(self.name.encode())

    @property
    def available_at(self) -> float:
        return max(self.ejected_until, self.check_failed_until)

    def available(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.available_at

    def serves(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.ejected_until = self.check_failed_until = 0.0

    def check_failed(self, hold_s: float, now: float | None = None) -> None:
        self.check_failed_until = (time.monotonic() if now is None else now) + hold_s

    def check_passed(self) -> None:
        """A passing health check lifts only its own ejection: a backend that answers ``/models``
        but fails requests (502/503/504) keeps backing off until its pause ends."""
        self.check_failed_until = 0.0

    def record_failure(self, now: float | None = None) -> None:
        self.consecutive_failures += 1
        backoff = min(EJECT_MAX_S, EJECT_BASE_S * 2 ** (self.consecutive_failures - 1))
        self.ejected_until = (time.monotonic() if now is None else now) + backoff
