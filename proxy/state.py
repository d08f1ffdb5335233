"""The long-lived objects one proxy app shares across requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from proxy.backends import BackendPool
from proxy.canonicalizer import Canonicalizer, PrefixTracker
from proxy.config import Settings
from proxy.metrics import Metrics
from proxy.models_info import ModelCatalog
from proxy.sessions.service import SessionService
from proxy.tenants import TenantDirectory
from proxy.tokenization import TokenCounter

if TYPE_CHECKING:
    from proxy.compaction import CompactionService


@dataclass
class ProxyState:
    settings: Settings
    metrics: Metrics
    upstream: BackendPool
    canonicalizer: Canonicalizer
    prefixes: PrefixTracker
    sessions: SessionService
    tenants: TenantDirectory
    models: ModelCatalog
    token_counter: TokenCounter
    compaction: CompactionService = field(init=False)


def get_state(request: Request) -> ProxyState:
    state: ProxyState = request.app.state.proxy
    return state
