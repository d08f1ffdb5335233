"""What the proxy depends on, checked: does each backend serve the API (``GET <base>/models``), does
the session store answer. Behind ``/readyz`` and the start-up line.

A backend is up only when its base URL lists models: one that answers 404 there is reachable but
configured with the wrong base path (``http://host:8000`` for ``http://host:8000/v1``), and every
chat request would get 404, so it is reported as such, with the URL to try.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from proxy.backends import Backend, BackendPool
from proxy.config_sources import masked_url
from proxy.sessions import SessionService, StoreUnavailable

UP = "up"
DOWN = "down"
WRONG_PATH = "wrong_path"
BROKEN = "error"
PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class BackendCheck:
    name: str
    url: str  # credentials masked
    status: str  # UP, DOWN (unreachable or 5xx), WRONG_PATH (no model list there), BROKEN
    models: tuple[str, ...] = ()
    detail: str = ""

    @property
    def serves_the_api(self) -> bool:
        return self.status == UP

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "url": self.url, "status": self.status}
        if self.models:
            out["models"] = list(self.models)
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass(frozen=True)
class StoreCheck:
    kind: str  # "memory" or "redis"
    status: str  # UP or DOWN
    url: str = ""  # credentials masked

    def summary(self) -> dict[str, Any]:
        out = {"kind": self.kind, "status": self.status}
        if self.url:
            out["url"] = self.url
        return out


@dataclass(frozen=True)
class Readiness:
    backends: list[BackendCheck]
    store: StoreCheck
    store_required: bool = True
    reasons: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return not self.reasons


async def check_backend(backend: Backend, timeout_s: float = PROBE_TIMEOUT_S) -> BackendCheck:
    upstream = backend.upstream
    url = masked_url(upstream.base_url)
    response = await upstream.get_models(timeout_s=timeout_s)
    if response is None:
        return BackendCheck(backend.name, url, DOWN, detail=f"unreachable: nothing answers at {url}")
    status = response.status_code
    if status >= 500:
        return BackendCheck(backend.name, url, DOWN, detail=f"GET {url}/models answered {status}")
    if status in (401, 403):
        # It serves the API; requests carry their own credentials (a tenant's or the client's).
        return BackendCheck(backend.name, url, UP, detail=f"GET {url}/models answered {status} to the proxy's key")
    listing = _model_data(response) if status == 200 else None
    if listing is not None:
        models = tuple(str(m["id"]) for m in listing if isinstance(m, dict) and m.get("id") is not None)
        return BackendCheck(backend.name, url, UP, models, "" if models else "it serves no model yet")
    hint = f"; did you mean {url}/v1?" if not upstream.base_url.endswith("/v1") else ""
    return BackendCheck(
        backend.name, url, WRONG_PATH, detail=f"GET {url}/models answered {status}, not a model list{hint}"
    )


async def check_store(sessions: SessionService, kind: str, url: str) -> StoreCheck:
    if kind == "memory":
        return StoreCheck(kind, UP)
    try:
        answered = await sessions.call(sessions.store.ping())
    except StoreUnavailable:
        answered = False
    return StoreCheck(kind, UP if answered else DOWN, masked_url(url))


async def check(
    pool: BackendPool, sessions: SessionService, store_kind: str, store_url: str, *, store_required: bool
) -> Readiness:
    backends, store = await asyncio.gather(
        asyncio.gather(*(check_backend(b) for b in pool.backends)), check_store(sessions, store_kind, store_url)
    )
    reasons = []
    if not any(b.serves_the_api for b in backends):
        reasons.append("no backend serves the API")
    if store.status != UP and store_required:
        reasons.append("the session store is down")
    return Readiness(list(backends), store, store_required, reasons)


def _model_data(response: Any) -> list[Any] | None:
    """The ``data`` list of a model listing, or None when the answer is not one."""
    try:
        data = response.json().get("data")
    except (ValueError, AttributeError):
        return None
    return data if isinstance(data, list) else None
