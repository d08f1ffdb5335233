"""The FastAPI application: wiring only; behaviour lives in the modules it wires."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.app_state import ProxyState
from proxy.backends import (
    Backend,
    BackendPool,
    EchoedHeaders,
    ModelCatalog,
    OutlierDetection,
    Upstream,
    backend_name,
    make_policy,
)
from proxy.canon import Canonicalizer, PrefixTracker, expire_idle_tool_forms
from proxy.capacity import resolve_shape
from proxy.chat import CompactionService, RequestSizes, TurnServices, UsageAdmission
from proxy.config import Settings
from proxy.http import (
    DirectRoutes,
    InvalidPath,
    ProxyError,
    canonicalize_scope,
    error_body,
    invalid_path,
    json_response,
    serve_direct,
)
from proxy.observability import CacheBreakTracker, CaptureWriter, Metrics, start_tracing
from proxy.openai import Continuations, expire_idle_lists
from proxy.reload import on_sighup
from proxy.replicas import build_shared
from proxy.routes import (
    admin,
    chat,
    compaction,
    health,
    messages,
    passthrough,
    responses,
    shadowing,
    ui,
    unrewritten,
)
from proxy.sessions import MemorySessionStore, RedisSessionStore, SessionService, SessionStore, StoreUnavailable
from proxy.startup import announce
from proxy.tenants import SALT_SECRET_NAME, SaltKey, TenantDirectory
from proxy.tokenization import TokenCounter

GAUGE_INTERVAL_S = 15.0
SALT_KEY_RETRY_S = 5.0
# The longest start-up waits for the backends' first health check.
FIRST_CHECK_WAIT_S = 1.0


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
            cluster=sessions.redis_cluster,
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
                keepalive_s=settings.upstream_keepalive_s,
                transport=transport,
            ),
        )
        for url in settings.upstream_urls
    ]
    routing = settings.routing
    return BackendPool(
        backends,
        make_policy(routing.policy, routing.balance_factor),
        metrics,
        key_headers=routing.key_headers,
        outliers=OutlierDetection.from_settings(routing),
    )


def echoed_headers(names: list[str], sessions: SessionService) -> EchoedHeaders:
    """Router headers echoed through the session store (with its timeout and degradation)."""

    async def load(digest: str) -> dict[str, str] | None:
        try:
            return await sessions.call(sessions.store.get_route_headers(digest))
        except StoreUnavailable:
            return None

    def save(digest: str, headers: dict[str, str]) -> None:
        async def write() -> None:
            with contextlib.suppress(StoreUnavailable):
                await sessions.call(sessions.store.set_route_headers(digest, headers))

        sessions.spawn(write())

    return EchoedHeaders(names, load, save)


logger = logging.getLogger("prefix_proxy.app")


def unexpected_error(exc: Exception) -> Response:
    """The answer to an exception nothing else answered: a ProxyError's own, else a logged 500."""
    if isinstance(exc, ProxyError):
        return exc.response()
    logger.exception("unhandled error", exc_info=exc)
    return json_response(error_body("internal proxy error", "server_error", None, "internal_error"), 500)


class ProxyApp(FastAPI):
    """FastAPI, with the forwarded API's fixed paths served directly (:mod:`proxy.http.direct`).

    Every HTTP request's path is made canonical first (:mod:`proxy.http.paths`): the one place
    that decides which route a request reaches, so no spelling of a route skips its pipeline.

    The direct endpoints skip the framework's own layers (its error and exception middleware, the
    exit stack, route matching), which they do not need: they answer their own errors. They do
    not skip middleware added to the app (``add_middleware``, ``@app.middleware``): that wraps
    them as it wraps every other route, so a middleware cannot miss the pipeline's endpoints."""

    direct = DirectRoutes()
    _direct_stack: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                canonicalize_scope(scope)
            except InvalidPath:
                await invalid_path().response()(scope, receive, send)
                return
        if self.direct.match(scope) is None:
            await super().__call__(scope, receive, send)
            return
        if self._direct_stack is None:
            self._direct_stack = self._in_user_middleware(self._serve_direct)
        await self._direct_stack(scope, receive, send)

    def _in_user_middleware(self, app: ASGIApp) -> ASGIApp:
        """``app`` inside the middleware added to this app, in the order the framework applies it."""
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return app

    async def _serve_direct(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.direct.match(scope)
        if endpoint is None:
            # A middleware sent the request elsewhere: the routes answer it (matched again).
            await self.router(scope, receive, send)
            return
        await serve_direct(self, endpoint, unexpected_error, scope, receive, send)


def create_app(
    settings: Settings | None = None,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    reload: Callable[[], Settings] | None = None,
) -> FastAPI:
    """The proxy app for ``settings``; ``reload`` gives the settings again on SIGHUP (``serve``)."""
    settings = settings or Settings()
    metrics = Metrics(settings.metrics_max_label_values, tenants=[t.name for t in settings.tenants])
    upstream = build_backends(settings, metrics, transport)
    store, redis_store = build_store(settings)
    # The forwarded messages of each tenant's conversations, last request each, with what the
    # session's fingerprints, the budget's sizes and the miss explanation's digests derived from
    # them: the next request of a conversation works out only what it adds (proxy.openai.continuation).
    conversations: Continuations[Any] = Continuations()
    sessions = SessionService(store, settings.sessions, metrics, forwarded=conversations)
    if settings.routing.echo_headers:
        upstream.echo_from(echoed_headers(settings.routing.echo_headers, sessions))
    tenant_lookup = None
    if redis_store is not None and settings.sessions.tenants_in_redis:
        tenants_store = redis_store

        async def tenant_lookup(digest: str) -> str | None:
            # Through the session service: its timeout, and no Redis round trip per request while
            # an outage is known (StoreUnavailable at once).
            return await sessions.call(tenants_store.tenant_by_digest(digest))

    canonicalizer, shared_feed = Canonicalizer(settings.canon), None
    if settings.replicas.share_memories:
        canonicalizer, shared_feed = build_shared(settings, redis_store, metrics.shared_memory_entries)
    salt_key = SaltKey(settings.cache_salt_secret.get_secret_value() if settings.cache_salt_secret else None)
    tenants = TenantDirectory(
        settings.tenants, tenant_lookup, isolate_caches=settings.tenant_cache_isolation, salt_key=salt_key
    )
    models = ModelCatalog(
        upstream, ttl_s=settings.max_model_len_cache_s, ollama_num_ctx=settings.engines.ollama_num_ctx
    )
    state = ProxyState(
        settings=settings,
        metrics=metrics,
        backends=upstream,
        canonicalizer=canonicalizer,
        prefixes=PrefixTracker(),
        sessions=sessions,
        tenants=tenants,
        models=models,
        token_counter=TokenCounter(),
        compaction=CompactionService(
            settings.summarizer,
            sessions,
            upstream,
            tenants,
            metrics,
            UsageAdmission(lambda: state.settings, sessions, metrics),  # the settings in force (a reload)
            models=models,
        ),
    )
    state.turn_services = TurnServices(
        sessions=state.sessions,
        models=state.models,
        compaction=state.compaction,
        metrics=metrics,
        canonicalizer=canonicalizer,
        backends=upstream,
        token_counter=state.token_counter,
        request_sizes=RequestSizes(conversations),
    )
    state.cache_breaks = CacheBreakTracker(settings.cache_breaks, metrics, forwarded=conversations)
    state.capture = CaptureWriter.from_settings(settings.capture)
    state.tracing = start_tracing(settings.tracing)
    state.apps = ui.book(settings)
    state.shadow = shadowing.rewrite_shadow(settings)
    kv_bytes_per_token = (
        resolve_shape(settings.kv_model, settings.kv_config_json).bytes_per_token(settings.kv_dtype)
        if settings.kv_model or settings.kv_config_json
        else 0
    )

    async def refresh_gauges() -> None:
        while True:
            # What tool lists hold, released once no request used it for a while.
            expire_idle_tool_forms()
            expire_idle_lists()
            try:
                active, context_tokens = await sessions.call(
                    store.stats(time.time() - settings.sessions_active_window_s)
                )
                metrics.sessions_active.set(active)
                metrics.session_kv_bytes.set(context_tokens * kv_bytes_per_token)
            except StoreUnavailable:
                pass
            await asyncio.sleep(GAUGE_INTERVAL_S)

    async def agree_on_salt_key() -> None:
        """Take the replicas' shared salt key from the store (creating it if first), retrying while
        the store is down: until then this replica salts with a key of its own."""
        while True:
            try:
                salt_key.adopt_shared(await sessions.call(store.shared_secret(SALT_SECRET_NAME, SaltKey.candidate())))
                return
            except StoreUnavailable:
                logger.warning(
                    "the session store is unavailable: cache salts use this replica's own key until it is back"
                )
            await asyncio.sleep(SALT_KEY_RETRY_S)

    async def announce_start() -> None:
        """The start-up line, once the upstreams and the store were probed (in the background: a
        backend that is slow to answer must not delay serving)."""
        announce(settings, await health.check_dependencies(state))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        background = [asyncio.create_task(refresh_gauges()), asyncio.create_task(announce_start())]
        stop_reloading = on_sighup(state, reload) if reload is not None else None
        if redis_store is not None and not salt_key.settled:
            agreeing = asyncio.create_task(agree_on_salt_key())
            # Before the first request when the store answers; in the background when it does not.
            await asyncio.wait([agreeing], timeout=settings.sessions.operation_timeout_s * 4)
            background.append(agreeing)
        interval = settings.routing.health_check_interval_s
        if not upstream.single and interval > 0:
            checked = asyncio.Event()
            background.append(asyncio.create_task(upstream.run_health_checks(interval, checked)))
            # Serving starts once the first round knows which backends answer, or FIRST_CHECK_WAIT_S
            # on (a backend slow to answer must not delay serving long).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(checked.wait(), FIRST_CHECK_WAIT_S)
        if shared_feed is not None:
            background.append(asyncio.create_task(shared_feed.run()))
        try:
            yield
        finally:
            if stop_reloading is not None:
                stop_reloading()
            for task in background:
                task.cancel()
            await sessions.drain()
            if shared_feed is not None:
                await shared_feed.aclose()
            await store.aclose()
            await upstream.aclose()
            if state.capture is not None:
                state.capture.close()
            if state.tracing is not None:
                # Exports what is queued: off the event loop (a collector that hangs blocks a thread).
                await asyncio.to_thread(state.tracing.shutdown)

    app = ProxyApp(title="prefix-proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = state
    # The forwarded API takes the raw request anyway, so it runs as plain Starlette routes:
    # FastAPI's dependency layer would add ~0.2 ms to every proxied request (bench/overhead.py).
    # The compaction route first: /v1/responses/compact is not a stored response's id.
    forwarded = [*chat.routes, *messages.routes, *compaction.routes, *responses.routes, *unrewritten.routes]
    app.router.routes.extend(forwarded)
    app.direct = DirectRoutes(forwarded)
    if settings.metrics_port is None:
        app.router.routes.append(health.metrics_route(state))
        if settings.ui.enabled:
            app.router.routes.append(ui.route(state))
    for module in (health, admin):
        app.include_router(module.router)
    # Last: whatever else the backend serves (it matches every path).
    app.router.routes.extend(passthrough.routes(app.router.routes))

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
        return unexpected_error(exc)

    return app


def create_metrics_app(app: FastAPI) -> Starlette:
    """``GET /metrics`` of ``app`` alone, for its own listen address (``metrics_port``); ``GET /ui``
    beside it when the operator's page is on."""
    state: ProxyState = app.state.proxy
    routes = [health.metrics_route(state)]
    if state.settings.ui.enabled:
        routes.append(ui.route(state))
    return Starlette(routes=routes)
