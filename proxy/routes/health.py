"""Liveness, readiness and the Prometheus scrape endpoint."""

from __future__ import annotations

import hmac

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.app_state import ProxyState, get_state
from proxy.http.errors import ProxyError, json_response
from proxy.tenants import bearer_token, unauthorized

router = APIRouter()


@router.get("/healthz")
async def healthz() -> Response:
    return json_response({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    pool = get_state(request).backends
    if pool.single:
        if await pool.ready():
            return json_response({"status": "ready"})
        return json_response({"status": "upstream unreachable"}, status=503)
    # Ready while any backend answers; the body says which ones do (names, never URLs).
    up = await pool.backends_answering()
    ready = any(up.values())
    body = {
        "status": "ready" if ready else "upstream unreachable",
        "backends": {name: "up" if ok else "down" for name, ok in up.items()},
    }
    return json_response(body, status=200 if ready else 503)


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
        raise unauthorized("invalid or missing metrics key")
