"""The FastAPI application: wiring only; behaviour lives in the modules it wires."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from proxy.backends import Backend, BackendPool, backend_name, make_policy
from proxy.canonicalizer import Canonicalizer, PrefixTracker
from proxy.compaction import CompactionService
from proxy.config import Settings
from proxy.errors import ProxyError, error_body, json_response
from proxy.kvcache import resolve_shape
from proxy.metrics import Metrics
from proxy.models_info import ModelCatalog
from proxy.routes import admin, chat, health, passthrough
from proxy.sessions.memory import MemorySessionStore
from proxy.sessions.redis_store import RedisSessionStore
from proxy.sessions.service import SessionService, StoreUnavailable
from proxy.sessions.store import SessionStore
from proxy.state import ProxyState
from proxy.tenants import TenantDirectory
from proxy.tokenization import TokenCounter
from proxy.upstream import Upstream

GAUGE_INTERVAL_S = 15.0


def build_store(settings: Settings) -> tuple[SessionStore, RedisSessionStore | None]:
    sessions = settings.sessions
    if sessions.store == "redis":
        store = RedisSessionStore(
            sessions.redis_url,
            prefix=sessions.key_prefix,
            ttl_s=sessions.ttl_s,
            timeout_s=sessions.operation_timeout_s,
            sentinels=sessions.redis_sentinels,
            sentinel_service=sessions.redis_sentinel_service,
            sentinel_password=(
                sessions.redis_sentinel_password.get_secret_value() if sessions.redis_sentinel_password else None
            ),
        )
        return store, store
    return MemorySessionStore(sessions.ttl_s), None


def build_backends(
    settings: Settings, metrics: Metrics, transport: httpx.AsyncBaseTransport | None = None
) -> BackendPool:
    api_key = settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None
    backends = [
        Backend(
            backend_name(url),
            Upstream(
                url,
                api_key=api_key,
                connect_timeout_s=settings.connect_timeout_s,
                timeout_s=settings.upstream_timeout_s,
                max_connections=settings.max_connections,
                transport=transport,
                use_aiohttp=settings.upstream_transport == "aiohttp",
            ),
        )
        for url in settings.upstream_urls
    ]
    routing = settings.routing
    return BackendPool(backends, make_policy(routing.policy, routing.balance_factor), metrics)


logger = logging.getLogger("prefix_proxy.app")


def create_app(settings: Settings | None = None, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics(settings.metrics_max_label_values, tenants=[t.name for t in settings.tenants])
    upstream = build_backends(settings, metrics, transport)
    store, redis_store = build_store(settings)
    sessions = SessionService(store, settings.sessions, metrics)
    tenant_lookup = None
    if redis_store is not None and settings.sessions.tenants_in_redis:
        tenant_lookup = redis_store.tenant_by_digest
    state = ProxyState(
        settings=settings,
        metrics=metrics,
        upstream=upstream,
        canonicalizer=Canonicalizer(settings.canon),
        prefixes=PrefixTracker(),
        sessions=sessions,
        tenants=TenantDirectory(settings.tenants, tenant_lookup, isolate_caches=settings.tenant_cache_isolation),
        models=ModelCatalog(upstream, ttl_s=settings.max_model_len_cache_s),
        token_counter=TokenCounter(),
    )
    state.compaction = CompactionService(state)
    kv_bytes_per_token = (
        resolve_shape(settings.kv_model, settings.kv_config_json).bytes_per_token(settings.kv_dtype)
        if settings.kv_model or settings.kv_config_json
        else 0
    )

    async def refresh_gauges() -> None:
        while True:
            try:
                active, context_tokens = await sessions.call(
                    store.stats(time.time() - settings.sessions_active_window_s)
                )
                metrics.sessions_active.set(active)
                metrics.session_kv_bytes.set(context_tokens * kv_bytes_per_token)
            except StoreUnavailable:
                pass
            await asyncio.sleep(GAUGE_INTERVAL_S)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        background = [asyncio.create_task(refresh_gauges())]
        interval = settings.routing.health_check_interval_s
        if not upstream.single and interval > 0:
            background.append(asyncio.create_task(upstream.run_health_checks(interval)))
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await state.compaction.drain()
            await sessions.drain()
            await store.aclose()
            await upstream.aclose()

    app = FastAPI(title="prefix-proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = state
    # The forwarded API takes the raw request anyway, so it runs as plain Starlette routes:
    # FastAPI's dependency layer would add ~0.2 ms to every proxied request (bench/overhead.py).
    app.router.routes.extend([*chat.routes, *passthrough.routes])
    for module in (health, admin):
        app.include_router(module.router)

    @app.exception_handler(ProxyError)
    async def proxy_error(_: Request, exc: ProxyError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), error_type, None, str(exc.status_code))
        return json_response(body, exc.status_code, dict(exc.headers) if exc.headers else None)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return json_response(error_body("internal proxy error", "server_error", None, "internal_error"), 500)

    return app
