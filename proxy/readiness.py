"""What the proxy depends on, checked: does each backend serve the API (``GET <base>/models``), does
the session store answer. Behind ``/readyz``, the start-up line and ``prefix_proxy_readiness``.

A backend is up only when its base URL lists models: one that answers 404 there is reachable but
configured with the wrong base path (``http://host:8000`` for ``http://host:8000/v1``), and every
chat request would get 404, so it is reported as such, with the URL to try. One that answers 401 or
403 to the credentials the proxy sends of its own (``upstream_api_key``, or none) refuses every
request the proxy makes for a client: ``auth_failed``, unless every request carries a tenant's own
upstream key instead.

Ready: some backend serves the API. Degraded: ready, its session store down (it serves without
sessions meanwhile): still ready unless ``readiness.require_store``, so that an outage of the store
every replica shares does not take them all out of the load balancer at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from proxy.backends import (
    GENERIC,
    LLAMA_SERVER,
    OLLAMA,
    Backend,
    BackendPool,
    context_of,
    described_context,
    engine_of,
)
from proxy.config_sources import masked_url
from proxy.sessions import SessionService, StoreUnavailable

UP = "up"
DOWN = "down"
WRONG_PATH = "wrong_path"
AUTH_FAILED = "auth_failed"
BROKEN = "error"
PROBE_TIMEOUT_S = 3.0

# The replica's state: /readyz's status (200 unless NOT_READY), prefix_proxy_readiness's label.
READY = "ready"
DEGRADED = "degraded"
NOT_READY = "not ready"
STATES = (READY, DEGRADED, NOT_READY)


@dataclass(frozen=True)
class BackendCheck:
    name: str
    url: str  # credentials masked
    status: str  # UP, DOWN (unreachable or 5xx), WRONG_PATH (no model list there), AUTH_FAILED, BROKEN
    models: tuple[str, ...] = ()
    detail: str = ""
    # The engine its listing names (proxy.backends.engines), and each model's context there (None:
    # the listing does not say, as Ollama's does not).
    engine: str = ""
    contexts: tuple[int | None, ...] = ()

    @property
    def serves_the_api(self) -> bool:
        return self.status == UP

    def engine_summary(self) -> dict[str, Any]:
        """The engine, and the context of its model (one number; a list for several)."""
        contexts = sorted({c for c in self.contexts if c is not None})
        context: int | list[int] | None = contexts[0] if len(contexts) == 1 else (contexts or None)
        return {"engine": self.engine, "context": context}

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "url": self.url, "status": self.status}
        if self.engine:
            out["engine"] = self.engine
        if self.models:
            out["models"] = list(self.models)
        if self.contexts:
            out["context"] = dict(zip(self.models, self.contexts, strict=False))
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass(frozen=True)
class StoreCheck:
    kind: str  # "memory" or "redis"
    status: str  # UP or DOWN
    url: str = ""  # credentials masked
    # What a store that answered with an error said (a refused password, a database that does not
    # exist); empty where it did not answer.
    answered: str = ""

    def summary(self) -> dict[str, Any]:
        out = {"kind": self.kind, "status": self.status}
        if self.url:
            out["url"] = self.url
        if self.answered:
            out["answered"] = self.answered
        return out


@dataclass(frozen=True)
class Readiness:
    backends: list[BackendCheck]
    store: StoreCheck
    store_required: bool = True
    # Why the replica is not ready (503), and what it does without while ready (200, degraded).
    reasons: list[str] = field(default_factory=list)
    degraded: list[str] = field(default_factory=list)
    # What the operator should know of the deployment as configured (ready or not).
    warnings: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return not self.reasons

    @property
    def state(self) -> str:
        """READY, DEGRADED (ready, without something it can serve without) or NOT_READY."""
        if self.reasons:
            return NOT_READY
        return DEGRADED if self.degraded else READY


async def check_backend(
    backend: Backend, timeout_s: float = PROBE_TIMEOUT_S, *, own_keys_only: bool = False
) -> BackendCheck:
    """``own_keys_only``: every request carries a tenant's own upstream key, never the proxy's."""
    upstream = backend.upstream
    url = masked_url(upstream.base_url)
    response, why = await upstream.models_or_why(timeout_s=timeout_s)
    if response is None:
        return BackendCheck(backend.name, url, DOWN, detail=f"unreachable: {why or 'nothing answers'} at {url}")
    status = response.status_code
    if status >= 500:
        return BackendCheck(backend.name, url, DOWN, detail=f"GET {url}/models answered {status}")
    if status in (401, 403):
        if own_keys_only:
            return BackendCheck(
                backend.name,
                url,
                UP,
                detail=f"GET {url}/models answered {status} to the proxy; tenants send their own keys",
            )
        sent = "the proxy's upstream_api_key" if upstream.credentials else "no key (upstream_api_key is not set)"
        return BackendCheck(
            backend.name,
            url,
            AUTH_FAILED,
            detail=f"GET {url}/models answered {status} to {sent}: set upstream_api_key to the key the upstream "
            "expects (vLLM: its --api-key)",
        )
    listing = _model_data(response) if status == 200 else None
    if listing is not None:
        entries = [m for m in listing if isinstance(m, dict) and m.get("id") is not None]
        models = tuple(str(m["id"]) for m in entries)
        engine = engine_of(entries[0]) if entries else GENERIC
        contexts = tuple(context_of(m) for m in entries)
        if None in contexts:
            # Said elsewhere by the engine itself (llama-server's /props, TGI's /info).
            described = await described_context(upstream, engine)
            contexts = tuple(described if context is None else context for context in contexts)
        detail = "" if models else "it serves no model yet"
        return BackendCheck(backend.name, url, UP, models, detail, engine, contexts)
    hint = f"; did you mean {url}/v1?" if not upstream.base_url.endswith("/v1") else ""
    return BackendCheck(
        backend.name, url, WRONG_PATH, detail=f"GET {url}/models answered {status}, not a model list{hint}"
    )


async def check_store(sessions: SessionService, kind: str, url: str) -> StoreCheck:
    if kind == "memory":
        return StoreCheck(kind, UP)
    try:
        answered = await sessions.call(sessions.store.ping())
    except StoreUnavailable as error:
        return StoreCheck(kind, DOWN, masked_url(url), error.reason)
    return StoreCheck(kind, UP if answered else DOWN, masked_url(url))


async def check(
    pool: BackendPool,
    sessions: SessionService,
    store_kind: str,
    store_url: str,
    *,
    store_required: bool,
    own_keys_only: bool = False,
    salted: bool = False,
) -> Readiness:
    """``salted``: each tenant's requests carry a cache salt of its own (``tenant_cache_isolation``)."""
    backends, store = await asyncio.gather(
        asyncio.gather(*(check_backend(b, own_keys_only=own_keys_only) for b in pool.backends)),
        check_store(sessions, store_kind, store_url),
    )
    reasons, degraded = [], []
    if not any(b.serves_the_api for b in backends):
        refused = any(b.status == AUTH_FAILED for b in backends)
        reasons.append("the upstream refuses the proxy's credentials" if refused else "no backend serves the API")
    if store.status != UP:
        if store_required:
            reasons.append("the session store is down")
        else:
            degraded.append("the session store is down: serving without sessions")
    warnings: list[str] = []
    if salted:
        warnings.extend(
            f"{b.name}: {b.engine} takes no cache_salt, so tenants share its prompt cache (a fast answer tells "
            "a tenant another sent the same prefix): one engine per tenant keeps them apart; "
            "tenant_cache_isolation: false says they may share"
            for b in backends
            if b.serves_the_api and b.engine in UNSALTED_ENGINES
        )
    return Readiness(list(backends), store, store_required, reasons, degraded, warnings)


# Engines that share one prompt cache between every request (no cache_salt): llama.cpp's
# llama-server, and Ollama, which runs it.
UNSALTED_ENGINES = (LLAMA_SERVER, OLLAMA)


def _model_data(response: Any) -> list[Any] | None:
    """The ``data`` list of a model listing, or None when the answer is not one."""
    try:
        data = response.json().get("data")
    except (ValueError, AttributeError):
        return None
    return data if isinstance(data, list) else None
