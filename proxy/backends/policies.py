"""Routing policies: given the backends and a request's routing key, the order to try them in.

Each policy returns *every* backend it is given, best first, so the pool can fail over down the
list. Policies only rank; health and model filtering happen in :class:`proxy.backends.BackendPool`.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import xxhash

from proxy.backends.backend import Backend


class RoutingPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def rank(self, backends: Sequence[Backend], key: str | None) -> list[Backend]:
        """``backends`` (non-empty) in the order to try them."""


class RoundRobin(RoutingPolicy):
    """Each request to the next backend: even spread, no cache locality."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, backends: Sequence[Backend], key: str | None) -> list[Backend]:
        start = next(self._counter) % len(backends)
        return [*backends[start:], *backends[:start]]


class LeastInFlight(RoutingPolicy):
    """The backend with the fewest requests in flight (ties in turn): even load, no locality."""

    name = "least_in_flight"

    def __init__(self) -> None:
        self._tie_break = RoundRobin()

    def rank(self, backends: Sequence[Backend], key: str | None) -> list[Backend]:
        return sorted(self._tie_break.rank(backends, None), key=lambda b: b.in_flight)


class Affinity(RoutingPolicy):
    """Requests with the same key go to the same backend, so their prefix is in its cache.

    Rendezvous hashing: each backend scores ``hash(key, backend)`` and the highest wins, so adding
    or losing a backend moves only the keys that scored highest on it, and every proxy replica picks
    the same backend for a key without sharing any state. Bounded load (Mirrokni et al., "Consistent
    Hashing with Bounded Loads"): a backend already carrying more than ``balance_factor`` times the
    average in-flight load is passed over for the next one in the key's order, so one busy
    conversation or app cannot pile onto a single server. Requests without a key go to the least
    loaded backend.
    """

    name = "affinity"

    def __init__(self, balance_factor: float = 2.0) -> None:
        if balance_factor < 1.0:
            raise ValueError("balance_factor must be >= 1")
        self.balance_factor = balance_factor
        self._keyless = LeastInFlight()

    def rank(self, backends: Sequence[Backend], key: str | None) -> list[Backend]:
        if key is None or len(backends) == 1:
            return self._keyless.rank(backends, None)
        raw = key.encode("utf-8", "surrogatepass")
        by_score = sorted(backends, key=lambda b: xxhash.xxh3_64_intdigest(raw, seed=b.seed), reverse=True)
        total = sum(b.in_flight for b in backends) + 1  # counting the request being placed
        # A factor of n or more would let one of n backends carry everything: cap it below n.
        factor = min(self.balance_factor, len(backends) - 0.5)
        cap = math.ceil(factor * total / len(backends))
        within = [b for b in by_score if b.in_flight < cap]
        return within + [b for b in by_score if b.in_flight >= cap]


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (Affinity, LeastInFlight, RoundRobin)}


def make_policy(name: str, balance_factor: float = 2.0) -> RoutingPolicy:
    if name == Affinity.name:
        return Affinity(balance_factor)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; one of {sorted(POLICIES)}") from None
