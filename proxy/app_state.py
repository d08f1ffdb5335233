"""The long-lived objects one proxy app shares across requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from proxy.backends import BackendPool, ModelCatalog
from proxy.canon import Canonicalizer, PrefixTracker
from proxy.chat import CompactionService, TurnServices
from proxy.config import Settings
from proxy.observability import Metrics
from proxy.sessions import SessionService
from proxy.tenants import TenantDirectory
from proxy.tokenization import TokenCounter

if TYPE_CHECKING:
    from proxy.observability import AppBook, CacheBreakTracker, CaptureWriter, RequestTracer, RewriteShadow


@dataclass
class ProxyState:
    settings: Settings
    metrics: Metrics
    backends: BackendPool
    canonicalizer: Canonicalizer
    prefixes: PrefixTracker
    sessions: SessionService
    tenants: TenantDirectory
    models: ModelCatalog
    token_counter: TokenCounter
    compaction: CompactionService
    # What a chat turn uses of the above, by name (built in proxy.app).
    turn_services: TurnServices = field(init=False)
    cache_breaks: CacheBreakTracker = field(init=False)
    capture: CaptureWriter | None = field(init=False, default=None)
    tracing: RequestTracer | None = field(init=False, default=None)
    # What the operator's page shows (ui.enabled; proxy.observability.apps).
    apps: AppBook | None = field(init=False, default=None)
    # Per app, what its requests as sent would cost beside what the forwarded ones cost
    # (canon.shadow; proxy.observability.shadow): None where nothing is rewritten.
    shadow: RewriteShadow | None = field(init=False, default=None)


def get_state(request: Request) -> ProxyState:
    state: ProxyState = request.app.state.proxy
    return state
