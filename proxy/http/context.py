"""Per-request state carried through the pipeline and into the access log."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.http.dialect import OPENAI, ErrorDialect
from proxy.ids import unique_id
from proxy.openai import Usage


class PendingCacheBreak(Protocol):
    """What the cache-break tracker leaves on a request until its answer settles it
    (``proxy.observability.tracker.PendingBreak``; declared here, so this layer imports no observer)."""

    @property
    def explanation(self) -> Any: ...

    def header(self) -> str: ...

    def settle(self, usage: Usage | None) -> bool: ...

    def record_reply(self, message: dict[str, Any] | None) -> None: ...


OVERHEAD_HEADER = "x-prefix-proxy-overhead-ms"


@dataclass(slots=True)
class RequestContext:
    route: str
    request_id: str = field(default_factory=unique_id)
    # ``request_id`` is the client's (its ``X-Request-Id``).
    client_named: bool = False
    # The id the engine got instead of the client's where tenants share the engine (vLLM names the
    # request by that header: one tenant's must not collide with another's); None: ``request_id``.
    engine_request_id: str | None = None
    started: float = field(default_factory=time.perf_counter)
    tenant: str = "anonymous"
    model: str | None = None
    stream: bool = False
    status: int = 200
    actions: list[str] = field(default_factory=list)
    prefix_hash: str | None = None
    session_id: str | None = None
    usage: Usage | None = None
    # perf_counter() times: request sent upstream, its headers back, its body done, first chunk relayed.
    upstream_sent_at: float | None = None
    upstream_headers_at: float | None = None
    upstream_done_at: float | None = None
    first_chunk_at: float | None = None
    # Seconds an earlier upstream request made for this one took (a compaction's summary before
    # the turn): upstream time, not the proxy's, though it comes before the turn is sent.
    upstream_before_s: float = 0.0
    error_code: str | None = None
    upstream_api_key: str | None = None
    saved_by_canonicalization: bool = False
    # Requests with the same routing key go to the same backend (its prefix cache holds them).
    route_key: str | None = None
    backend: str | None = None
    # The forwarded messages' roles differ from the client's (a message was inserted or removed).
    restructured: bool = False
    # The rewrite shadow has accounted this client request already (this is a retry of it): once
    # only, or the refused attempt's prompt, remembered as cached, makes the retry look free as sent.
    shadow_accounted: bool = False
    # perf_counter() time by which the whole answer must be sent (``request_timeout_s``).
    deadline: float = math.inf
    # Only with ``log_prompts: true``: the messages as forwarded, for debugging.
    logged_messages: list[Any] | None = None
    # Why this request missed the prefix cache (chat requests; docs/analysis.md).
    cache_break: PendingCacheBreak | None = None
    # The protocol's error shape (Anthropic clients get theirs on /v1/messages).
    dialect: ErrorDialect = OPENAI
    # The request's trace span (proxy.observability.tracing); None when tracing is off.
    span: Any = None

    def mark_upstream_sent(self) -> None:
        self.upstream_sent_at = time.perf_counter()

    def pre_upstream_seconds(self) -> float:
        end = self.upstream_sent_at if self.upstream_sent_at is not None else time.perf_counter()
        return end - self.started - self.upstream_before_s

    def overhead_seconds(self, now: float | None = None) -> float:
        """Proxy time so far: everything except the upstream's own time."""
        now = time.perf_counter() if now is None else now
        if self.upstream_sent_at is None:
            return now - self.started - self.upstream_before_s
        upstream_end = self.upstream_done_at or self.upstream_headers_at or self.upstream_sent_at
        return (self.upstream_sent_at - self.started - self.upstream_before_s) + max(0.0, now - upstream_end)

    def relay_start_overhead(self, headers_ready: float) -> float:
        """Proxy time of a relayed stream: until it started (the relay runs at the upstream's pace)."""
        assert self.upstream_headers_at is not None
        return self.pre_upstream_seconds() + (headers_ready - self.upstream_headers_at)

    def upstream_seconds(self) -> float | None:
        if self.upstream_sent_at is None or self.upstream_done_at is None:
            return None
        return self.upstream_done_at - self.upstream_sent_at

    def upstream_over(self) -> None:
        """An upstream request made on the way to the one the client asked for is done: its time
        counts as upstream time, and the next request's times start afresh."""
        if self.upstream_sent_at is not None:
            self.upstream_before_s += (self.upstream_done_at or time.perf_counter()) - self.upstream_sent_at
        self.upstream_sent_at = self.upstream_headers_at = self.upstream_done_at = None


def overhead_header(seconds: float) -> dict[str, str]:
    """The response header telling the client how long the proxy's own work took."""
    return {OVERHEAD_HEADER: f"{seconds * 1000:.3f}"}
