"""Prometheus metrics of the proxy (names documented in docs/metrics.md).

Label values that depend on requests (model, tenant) pass through a
:class:`BoundedLabel`: a misbehaving client cannot explode cardinality, nor put
a value into the exposition that breaks it (a lone surrogate cannot be written
as UTF-8). A model name becomes a label value only once an upstream has served
it: otherwise any client could mint series, and, since every tenant's requests
count in the same series, learn from a counter whether another tenant had sent
a model name it guessed.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Iterable
from functools import partial
from typing import Protocol, Self

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

from proxy import __version__
from proxy.openai import Usage


class WatchedBackend(Protocol):
    """What the backend gauges read of a backend (``proxy.backends.Backend``)."""

    name: str

    @property
    def in_flight(self) -> int: ...

    def available(self) -> bool: ...


LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
UPSTREAM_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OVERFLOW_LABEL = "other"


MAX_LABEL_CHARS = 128


class _ChildrenByValues(MetricWrapperBase):
    """``labels(...)`` answered from a dict after the first call for those values.

    prometheus_client validates, converts and locks on every ``labels`` call (a few microseconds),
    and a proxied request makes about ten of them. Label values here are bounded (routes, outcomes,
    :class:`BoundedLabel`), so the dict is too; series are never removed.
    """

    def labels(self, *labelvalues: object, **labelkwargs: object) -> Self:
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)
        try:
            return self._children_by_values[labelvalues]
        except AttributeError:
            self._children_by_values: dict[tuple[object, ...], Self] = {}
        except KeyError:
            pass
        child = self._children_by_values[labelvalues] = super().labels(*labelvalues)
        return child


class Counter(_ChildrenByValues, prometheus_client.Counter):
    pass


class Gauge(_ChildrenByValues, prometheus_client.Gauge):
    pass


class Histogram(_ChildrenByValues, prometheus_client.Histogram):
    pass


def printable_label(value: str) -> str:
    """``value`` as a label value any exposition can carry: valid UTF-8 (a lone surrogate becomes
    its ``\\ud800`` escape) and at most :data:`MAX_LABEL_CHARS` characters."""
    try:
        value.encode()
    except UnicodeEncodeError:
        value = value.encode("utf-8", "backslashreplace").decode()
    return value[:MAX_LABEL_CHARS]


class BoundedLabel:
    """Admits the first ``limit`` distinct values of a label; later ones read as ``other``.

    With ``auto_admit=False`` a value is used only after :meth:`admit` (for values a client
    chooses, admitted once something trustworthy vouched for them); until then it reads ``other``.
    """

    def __init__(self, limit: int, preset: tuple[str, ...] = (), *, auto_admit: bool = True) -> None:
        self._limit = limit
        # Each admitted value and the label value it is exported as.
        self._labels: dict[str, str] = {p: printable_label(p) for p in preset}
        self._auto_admit = auto_admit
        self._lock = threading.Lock()

    def __call__(self, value: str | None) -> str:
        if not value:
            return "unknown"
        label = self._labels.get(value)
        if label is not None:
            return label
        return self.admit(value) if self._auto_admit else OVERFLOW_LABEL

    def admit(self, value: str | None) -> str:
        """Admit ``value`` (while under the limit); returns its label value."""
        if not value:
            return "unknown"
        label = self._labels.get(value)
        if label is not None:
            return label
        with self._lock:
            if len(self._labels) < self._limit:
                label = self._labels[value] = printable_label(value)
                return label
        return OVERFLOW_LABEL


class Metrics:
    """All proxy metrics, on a registry of their own so several apps can live in one process."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_label_values: int = 64, tenants: list[str] | None = None) -> None:
        self.registry = CollectorRegistry()
        # Admitted by :meth:`confirm_model` once an upstream served the model (see the module doc).
        self.model_label = BoundedLabel(max_label_values, auto_admit=False)
        # Configured tenants are always labelled; others (Redis-provisioned) share the cap.
        self.tenant_label = BoundedLabel(max_label_values, preset=("anonymous", *(tenants or [])))
        r = self.registry
        # Which build answers: one series, always 1 (join on it: `* on(instance) group_left(version)`).
        self.build_info = prometheus_client.Info(
            "prefix_proxy_build", "The running prefix-proxy: version and Python.", registry=r
        )
        self.build_info.info({"version": __version__, "python": platform.python_version()})
        self.requests = Counter(
            "prefix_proxy_requests",
            "Requests answered, by route, HTTP status, model and tenant.",
            ["route", "status", "model", "tenant"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "prefix_proxy_upstream_errors",
            "Upstream failures by kind (unreachable, connection_lost: dropped after the request went out, timeout,"
            " http_4xx, http_5xx; invalid_response: an answer or"
            " stream that is not the protocol; invalid_usage: usage that cannot be true, not counted).",
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
        self.slow_clients = Counter(
            "prefix_proxy_slow_clients",
            "Connections cut because their request did not arrive in time, by reason.",
            ["reason"],
            registry=r,
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
        # Compaction a client asked for (docs/compaction.md): per protocol (responses, messages).
        self.client_compactions = Counter(
            "prefix_proxy_client_compactions",
            "Compactions served to clients that asked for one, by protocol and outcome (served, failed).",
            ["protocol", "outcome"],
            registry=r,
        )
        self.client_compaction_items = Counter(
            "prefix_proxy_client_compaction_items",
            "Compaction items clients sent back, by protocol and outcome (expanded, refused).",
            ["protocol", "outcome"],
            registry=r,
        )
        self.client_compaction_tokens_saved = Counter(
            "prefix_proxy_client_compaction_tokens_saved",
            "Prefill tokens a client compacting locally would have computed and the proxy's summary "
            "request did not (docs/metrics.md: how it is estimated).",
            ["protocol"],
            registry=r,
        )
        self.store_up = Gauge(
            "prefix_proxy_store_up", "1 when the session store answers, 0 while degraded.", registry=r
        )
        self.store_errors = Counter(
            "prefix_proxy_store_errors",
            "Session-store operations that failed (request served without sessions).",
            registry=r,
        )
        self.store_fallbacks = Counter(
            "prefix_proxy_store_fallbacks",
            "Sessions resolved from the replica's own copy because the session store could not answer.",
            registry=r,
        )
        self.shared_memory_entries = Counter(
            "prefix_proxy_shared_memory_entries",
            "Canonicalizer memory entries shared between replicas (replicas.share_memories), by direction.",
            ["direction"],
            registry=r,
        )
        self.store_up.set(1)
        self.readiness = Gauge(
            "prefix_proxy_readiness",
            "1 for the replica's state at its last readiness check (start-up, /readyz): ready, degraded "
            "(ready, serving without its session store) or not_ready.",
            ["state"],
            registry=r,
        )
        for state in ("ready", "degraded", "not_ready"):
            self.readiness.labels(state)
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
            "Attempts sent to a backend by outcome (ok, unreachable, timeout, http_5xx, http_429).",
            ["backend", "outcome"],
            registry=r,
        )
        self.backend_failovers = Counter(
            "prefix_proxy_backend_failovers",
            "Requests moved off a backend to the next one after it failed.",
            ["backend"],
            registry=r,
        )
        self.backend_ejections = Counter(
            "prefix_proxy_backend_ejections",
            "Backends taken out of rotation after failed requests, by reason (docs/routing.md).",
            ["backend", "reason"],
            registry=r,
        )
        self.cache_break_tokens = Counter(
            "prefix_proxy_cache_break_tokens",
            "Estimated prefill tokens lost to prefix-cache breaks, by cause (docs/analysis.md).",
            ["cause"],
            registry=r,
        )
        self.cache_breaks = Counter(
            "prefix_proxy_cache_breaks",
            "Requests whose prompt broke the cached prefix, by cause (docs/analysis.md).",
            ["cause"],
            registry=r,
        )
        # The shadow (docs/canonicalization.md): rewrites that lost against the requests as sent.
        self.shadow_prefill_tokens = Counter(
            "prefix_proxy_shadow_prefill_tokens",
            "Estimated prefill of chat requests as the client sent them and as forwarded (the shadow).",
            ["arrangement"],
            registry=r,
        )
        self.rewrite_trials = Counter(
            "prefix_proxy_rewrite_trials",
            "Apps' rewrite trials, by outcome: started again after a back-off, or stopped (cost more than as sent).",
            ["outcome"],
            registry=r,
        )
        self.requests_sent_as_is = Counter(
            "prefix_proxy_requests_forwarded_as_sent",
            "Chat requests forwarded as sent because their app's rewrites cost more than its shadow.",
            registry=r,
        )
        for arrangement in ("client", "forwarded"):
            self.shadow_prefill_tokens.labels(arrangement)
        for outcome in ("started", "stopped"):
            self.rewrite_trials.labels(outcome)
        # Known label values start at zero, so dashboards and alerts see a series before the first event.
        for outcome in ("started", "succeeded", "failed"):
            self.compactions.labels(outcome)
        for protocol in ("responses", "messages"):
            for outcome in ("served", "failed"):
                self.client_compactions.labels(protocol, outcome)
            for outcome in ("expanded", "refused"):
                self.client_compaction_items.labels(protocol, outcome)
            self.client_compaction_tokens_saved.labels(protocol)
        for tenant in ("anonymous", *(tenants or [])):
            for kind in ("context", "session", "tenant"):
                self.budget_rejections.labels(kind, self.tenant_label(tenant))
        for route in ("chat", "completions", "embeddings", "models"):
            for kind in (
                "unreachable",
                "connection_lost",
                "timeout",
                "http_4xx",
                "http_5xx",
                "auth_failed",
                "invalid_response",
                "invalid_usage",
            ):
                self.upstream_errors.labels(route, kind)
        for reuse in ("new", "repeat"):
            self.prefix_requests.labels(reuse)
        for reason in ("header_timeout", "body_timeout", "too_many_incomplete"):
            self.slow_clients.labels(reason)

    def watch_backends(self, backends: Iterable[WatchedBackend]) -> None:
        """Export each backend's health and load, read when Prometheus scrapes."""
        for backend in backends:
            self.backend_up.labels(backend.name).set_function(partial(_is_available, backend))
            self.backend_in_flight.labels(backend.name).set_function(partial(_in_flight, backend))
            self.backend_failovers.labels(backend.name)
            for outcome in ("ok", "unreachable", "timeout", "http_5xx", "http_429"):
                self.backend_requests.labels(backend.name, outcome)

    def confirm_model(self, model: str | None) -> None:
        """An upstream answered a request for ``model`` successfully: it is a real model name."""
        self.model_label.admit(model)

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


def _is_available(backend: WatchedBackend) -> float:
    return float(backend.available())


def _in_flight(backend: WatchedBackend) -> float:
    return float(backend.in_flight)
