"""The FastAPI application: wiring only; behaviour lives in the modules it wires."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from proxy.canonicalizer import Canonicalizer, PrefixTracker
from proxy.config import Settings
from proxy.errors import ProxyError, error_body, json_response
from proxy.metrics import Metrics
from proxy.routes import chat, health, passthrough
from proxy.state import ProxyState
from proxy.upstream import Upstream

logger = logging.getLogger("prefix_proxy.app")


def create_app(
    settings: Settings | None = None, *, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    settings = settings or Settings()
    upstream = Upstream(
        settings.upstream,
        api_key=settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None,
        connect_timeout_s=settings.connect_timeout_s,
        timeout_s=settings.upstream_timeout_s,
        max_connections=settings.max_connections,
        transport=transport,
    )
    state = ProxyState(
        settings=settings,
        metrics=Metrics(settings.metrics_max_label_values),
        upstream=upstream,
        canonicalizer=Canonicalizer(settings.canon),
        prefixes=PrefixTracker(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await upstream.aclose()

    app = FastAPI(title="prefix-proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = state
    for module in (chat, passthrough, health):
        app.include_router(module.router)

    @app.exception_handler(ProxyError)
    async def proxy_error(_: Request, exc: ProxyError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return json_response(
            error_body(str(exc.detail), error_type, None, str(exc.status_code)), exc.status_code
        )

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return json_response(error_body("internal proxy error", "server_error", None, "internal_error"), 500)

    return app
