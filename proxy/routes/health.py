"""Liveness, readiness and the Prometheus scrape endpoint."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import json_response
from proxy.state import get_state

router = APIRouter()


@router.get("/healthz")
async def healthz() -> Response:
    return json_response({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    pool = get_state(request).upstream
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


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = get_state(request).metrics
    return Response(registry.exposition(), media_type=registry.content_type)
