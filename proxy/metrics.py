"""Prometheus metrics of the proxy (names documented in docs/metrics.md).

Label values that come from clients (model, tenant) pass through a
:class:`BoundedLabel` so a misbehaving client cannot explode cardinality.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from proxy.usage import Usage

if TYPE_CHECKING:
    from proxy.backends import Backend

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
UPSTREAM_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OVERFLOW_LABEL = "other"


class BoundedLabel:
    """Admits the first ``limit`` distinct values of a label; later ones read as ``other``."""

    def __init__(self, limit: int, preset: tuple[str, ...] = ()) -> None:
        self._limit = limit
        self._seen: set[str] = set(preset)
        self._lock = threading.Lock()

    def __call__(self, value: str | None) -> str:
        if not value:
            return "unknown"
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) < self._limit:
                self._seen.add(value)
                return value
        return OVERFLOW_LABEL


class Metrics:
    """All proxy metrics, on a registry of their own so several apps can live in one process."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_label_values: int = 64, tenants: list[str] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_label = BoundedLabel(max_label_values)
        # Configured tenants are always labelled; others (Redis-provisioned) share the cap.
        self.tenant_label = BoundedLabel(max_label_values, preset=("anonymous", *(tenants or [])))
        r = self.registry
        self.requests = Counter(
            "prefix_proxy_requests",
            "Requests answered, by route, HTTP status, model and tenant.",
            ["route", "status", "model", "tenant"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "prefix_proxy_upstream_errors",
            "Upstream failures by kind (unreachable, timeout, http_4xx, http_5xx).",
            ["route", "kind"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "prefix_proxy_prompt_tokens",
            "Prompt tokens the upstream reported.",
            ["model", "tenant"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "prefix_proxy_cached_tokens",
            "Prompt tokens the upstream served from its prefix cache.",
            ["model", "tenant"],
            registry=r,
        )
        self.prefill_tokens = Counter(
            "prefix_proxy_prefill_tokens",
            "Prompt tokens the upstream had to compute (prompt - cached).",
            ["model", "tenant"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "prefix_proxy_completion_tokens",
            "Completion tokens the upstream reported.",
            ["model", "tenant"],
            registry=r,
        )
        self.tokens_saved = Counter(
            "prefix_proxy_tokens_saved",
            "Prefill tokens saved, by source (canonicalization, summary).",
            ["model", "tenant", "source"],
            registry=r,
        )
        self.canon_actions = Counter(
            "prefix_proxy_canon_actions", "Canonicalization rewrites applied, by kind.", ["kind"], registry=r
        )
        self.prefix_requests = Counter(
            "prefix_proxy_prefix_requests",
            "Requests by whether their stable prefix was seen before.",
            ["reuse"],
            registry=r,
        )
        self.overhead = Histogram(
            "prefix_proxy_overhead_seconds",
            "Time the proxy itself added to a request (excludes upstream time).",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_latency = Histogram(
            "prefix_proxy_upstream_seconds",
            "Upstream time, from sending the request to the last byte.",
            ["route"],
            buckets=UPSTREAM_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "prefix_proxy_time_to_first_token_seconds",
            "Time from request arrival to the first streamed chunk.",
            ["model"],
            buckets=UPSTREAM_BUCKETS,
            registry=r,
        )
        self.streams_cancelled = Counter(
            "prefix_proxy_streams_cancelled", "Streams closed because the client went away.", registry=r
        )
        self.sessions_active = Gauge(
            "prefix_proxy_sessions_active", "Sessions seen within the activity window.", registry=r
        )
        self.session_kv_bytes = Gauge(
            "prefix_proxy_session_kv_bytes",
            "KV-cache bytes the tracked sessions' contexts represent.",
            registry=r,
        )
        self.budget_rejections = Counter(
            "prefix_proxy_budget_rejections",
            "Requests refused by a budget, by kind.",
            ["kind", "tenant"],
            registry=r,
        )
        self.compactions = Counter(
            "prefix_proxy_compactions",
            "Summary compactions by outcome (started, succeeded, failed).",
            ["outcome"],
            registry=r,
        )
        self.compaction_seconds = Histogram(
            "prefix_proxy_compaction_seconds",
            "Time to compact a session.",
            buckets=UPSTREAM_BUCKETS,
            registry=r,
        )
        self.compaction_tokens_removed = Counter(
            "prefix_proxy_compaction_tokens_removed", "Tokens of history replaced by summaries.", registry=r
        )
        self.summary_tokens = Counter("prefix_proxy_summary_tokens", "Tokens of the summaries produced.", registry=r)
        self.store_up = Gauge(
            "prefix_proxy_store_up", "1 when the session store answers, 0 while degraded.", registry=r
        )
        self.store_errors = Counter(
            "prefix_proxy_store_errors",
            "Session-store operations that failed (request served without sessions).",
            registry=r,
        )
        self.store_up.set(1)
        self.backend_up = Gauge(
            "prefix_proxy_backend_up",
            "1 while a backend takes requests, 0 while it is ejected after failures.",
            ["backend"],
            registry=r,
        )
        self.backend_in_flight = Gauge(
            "prefix_proxy_backend_in_flight", "Requests in flight to a backend.", ["backend"], registry=r
        )
        self.backend_requests = Counter(
            "prefix_proxy_backend_requests",
            "Attempts sent to a backend by outcome (ok, unreachable, timeout, http_5xx).",
            ["backend", "outcome"],
            registry=r,
        )
        self.backend_failovers = Counter(
            "prefix_proxy_backend_failovers",
            "Requests moved off a backend to the next one after it failed.",
            ["backend"],
            registry=r,
        )
        # Known label values start at zero, so dashboards and alerts see a series before the first event.
        for outcome in ("started", "succeeded", "failed"):
            self.compactions.labels(outcome)
        for tenant in ("anonymous", *(tenants or [])):
            for kind in ("context", "session", "tenant"):
                self.budget_rejections.labels(kind, tenant)
        for route in ("chat", "completions", "embeddings", "models"):
            for kind in ("unreachable", "timeout", "http_4xx", "http_5xx"):
                self.upstream_errors.labels(route, kind)
        for reuse in ("new", "repeat"):
            self.prefix_requests.labels(reuse)

    def watch_backends(self, backends: Iterable[Backend]) -> None:
        """Export each backend's health and load, read when Prometheus scrapes."""
        for backend in backends:
            self.backend_up.labels(backend.name).set_function(partial(_is_available, backend))
            self.backend_in_flight.labels(backend.name).set_function(partial(_in_flight, backend))
            self.backend_failovers.labels(backend.name)
            for outcome in ("ok", "unreachable", "timeout", "http_5xx"):
                self.backend_requests.labels(backend.name, outcome)

    def record_usage(self, model: str, tenant: str, usage: Usage) -> None:
        model, tenant = self.model_label(model), self.tenant_label(tenant)
        self.prompt_tokens.labels(model, tenant).inc(usage.prompt_tokens)
        self.cached_tokens.labels(model, tenant).inc(usage.cached_tokens)
        self.prefill_tokens.labels(model, tenant).inc(usage.prefill_tokens)
        self.completion_tokens.labels(model, tenant).inc(usage.completion_tokens)

    def record_saved(self, model: str, tenant: str, source: str, tokens: int) -> None:
        self.tokens_saved.labels(self.model_label(model), self.tenant_label(tenant), source).inc(tokens)

    def record_request(self, route: str, status: int, model: str | None, tenant: str) -> None:
        self.requests.labels(route, str(status), self.model_label(model), self.tenant_label(tenant)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _is_available(backend: Backend) -> float:
    return float(backend.available())


def _in_flight(backend: Backend) -> float:
    return float(backend.in_flight)
