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
    """Ready when a backend serves the API and the configured store answers (unless
    ``sessions.ready_when_store_down``); the body says which do (backends by name, never URLs)."""
    state = get_state(request)
    result = await check_dependencies(state)
    body: dict[str, Any] = {
        "status": "ready" if result.ready else "not ready",
        "backends": {b.name: b.status for b in result.backends},
        "store": {"kind": result.store.kind, "status": result.store.status},
    }
    if result.reasons:
        body["reasons"] = result.reasons
    return json_response(body, status=200 if result.ready else 503)


async def check_dependencies(state: ProxyState) -> readiness.Readiness:
    sessions = state.settings.sessions
    return await readiness.check(
        state.backends,
        state.sessions,
        sessions.store,
        sessions.redis_url,
        store_required=not sessions.ready_when_store_down,
    )


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
