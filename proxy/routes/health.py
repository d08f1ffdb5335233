"""Liveness, readiness and the Prometheus scrape endpoint."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy import readiness
from proxy.app_state import ProxyState, get_state
from proxy.http import ProxyError, Unauthorized, json_response
from proxy.tenants import bearer_token

router = APIRouter()


@router.get("/healthz")
async def healthz() -> Response:
    return json_response({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """Ready (200) when a backend serves the API; "degraded" (still 200) while the session store is
    down, unless ``readiness.require_store`` makes that 503. The body says which dependency is what
    (backends by name, never URLs)."""
    state = get_state(request)
    result = await check_dependencies(state)
    body: dict[str, Any] = {
        "status": result.state,
        "backends": {b.name: b.status for b in result.backends},
        # The engine each backend is and the context a request may fill there (no model names).
        "engines": {b.name: b.engine_summary() for b in result.backends if b.engine},
        "store": {"kind": result.store.kind, "status": result.store.status},
    }
    if result.reasons:
        body["reasons"] = result.reasons
    if result.degraded:
        body["degraded"] = result.degraded
    if result.warnings:
        body["warnings"] = result.warnings
    return json_response(body, status=200 if result.ready else 503)


async def check_dependencies(state: ProxyState) -> readiness.Readiness:
    """The dependencies checked now; ``prefix_proxy_readiness`` set to what was found."""
    settings = state.settings
    tenants = settings.tenants
    result = await readiness.check(
        state.backends,
        state.sessions,
        settings.sessions.store,
        settings.sessions.redis_url,
        store_required=settings.readiness.require_store,
        # Every request then goes upstream with its tenant's key: a 401 to the proxy's own is expected.
        own_keys_only=bool(tenants)
        and all(t.upstream_api_key for t in tenants)
        and not settings.sessions.tenants_in_redis,
        salted=state.tenants.isolates_caches,
    )
    for name in readiness.STATES:
        state.metrics.readiness.labels(name.replace(" ", "_")).set(1 if name == result.state else 0)
    return result


def metrics_route(state: ProxyState) -> Route:
    """``GET /metrics`` for ``state``: on the API's own port, or alone on ``metrics_port``."""

    async def metrics(request: Request) -> Response:
        try:
            _require_metrics_key(state, request)
        except ProxyError as error:
            return error.response()
        registry = state.metrics
        return Response(registry.exposition(), media_type=registry.content_type)

    return Route("/metrics", metrics, methods=["GET"])


def _require_metrics_key(state: ProxyState, request: Request) -> None:
    configured = state.settings.metrics_api_key
    if configured is None or not configured.get_secret_value():
        return
    token = bearer_token(request.headers.get("authorization")) or ""
    if not hmac.compare_digest(token.encode(), configured.get_secret_value().encode()):
        raise Unauthorized("invalid or missing metrics key")
