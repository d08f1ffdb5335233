"""Per-request state carried through the pipeline and into the access log."""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

from proxy.usage import Usage

_PROCESS_ID = os.urandom(8).hex()
_SEQUENCE = itertools.count(1)


def new_request_id() -> str:
    """32 hex digits, unique across replicas and restarts: a random per-process half and a counter.

    Request ids need uniqueness, not unpredictability; this costs a tenth of ``uuid4()``.
    """
    return f"{_PROCESS_ID}{next(_SEQUENCE):016x}"


@dataclass
class RequestContext:
    route: str
    request_id: str = field(default_factory=new_request_id)
    started: float = field(default_factory=time.perf_counter)
    tenant: str = "anonymous"
    model: str | None = None
    stream: bool = False
    status: int = 200
    actions: list[str] = field(default_factory=list)
    prefix_hash: str | None = None
    session_id: str | None = None
    usage: Usage | None = None
    upstream_sent: float | None = None
    upstream_headers: float | None = None
    upstream_done: float | None = None
    first_chunk: float | None = None
    error_code: str | None = None
    upstream_api_key: str | None = None
    saved_by_canonicalization: bool = False
    # Requests with the same routing key go to the same backend (its prefix cache holds them).
    route_key: str | None = None
    backend: str | None = None
    # The forwarded messages' roles differ from the client's (a message was inserted or removed).
    restructured: bool = False
    # Only with ``log_prompts: true``: the messages as forwarded, for debugging.
    logged_messages: list[Any] | None = None

    def mark_upstream_sent(self) -> None:
        self.upstream_sent = time.perf_counter()

    def pre_upstream_seconds(self) -> float:
        end = self.upstream_sent if self.upstream_sent is not None else time.perf_counter()
        return end - self.started

    def overhead_seconds(self, now: float | None = None) -> float:
        """Proxy time so far: everything except the upstream's own time."""
        now = time.perf_counter() if now is None else now
        if self.upstream_sent is None:
            return now - self.started
        upstream_end = self.upstream_done or self.upstream_headers or self.upstream_sent
        return (self.upstream_sent - self.started) + max(0.0, now - upstream_end)

    def upstream_seconds(self) -> float | None:
        if self.upstream_sent is None or self.upstream_done is None:
            return None
        return self.upstream_done - self.upstream_sent
