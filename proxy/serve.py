"""Running the proxy under uvicorn: the API, and ``/metrics`` on its own address when configured.

Both servers bound how long a client may take to send its request (:mod:`proxy.http.inbound`):
uvicorn's HTTP protocol with header and request deadlines and a cap on requests still arriving,
and the app wrapped so that a read past the deadline is answered 408.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI
from uvicorn.config import STARTUP_FAILURE

from proxy.app import create_app, create_metrics_app
from proxy.config import Settings
from proxy.http import InboundLimits, ReadDeadline, deadline_protocol

SERVER_OPTIONS: dict[str, Any] = {"log_level": "warning", "access_log": False, "timeout_graceful_shutdown": 30}


class SidecarServer(uvicorn.Server):
    """A second server in the process: the API server handles the signals, this one stops with it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def server_config(
    app: Any,
    settings: Settings,
    proxy_app: FastAPI,
    *,
    http: Literal["auto", "httptools", "h11"] = "auto",
    **options: Any,
) -> uvicorn.Config:
    """uvicorn's config for serving ``app`` with the inbound deadlines (uvicorn's HTTP protocol ``http``);
    slow clients counted in ``proxy_app``'s metrics."""
    slow_clients = proxy_app.state.proxy.metrics.slow_clients

    def count(reason: str) -> None:
        slow_clients.labels(reason).inc()

    protocol = deadline_protocol(InboundLimits.from_settings(settings), count, http)
    return uvicorn.Config(ReadDeadline(app), http=protocol, **{**SERVER_OPTIONS, **options})


def serve(settings: Settings, *, reload: Callable[[], Settings] | None = None) -> None:
    """Serve until SIGTERM or SIGINT; SIGHUP calls ``reload`` and applies what it can (proxy.reload)."""
    app = create_app(settings, reload=reload)
    api = uvicorn.Server(server_config(app, settings, app, host=settings.host, port=settings.port))
    # Everything built so far (modules, settings, the app) lives as long as the process:
    # out of the collector's sight, a full collection walks only what requests leave behind.
    gc.freeze()
    if settings.metrics_port is None:
        # As uvicorn.run: Ctrl-C is a way to stop, and a server that could not start exits 3.
        with contextlib.suppress(KeyboardInterrupt):
            api.run()
        if not api.started:
            sys.exit(STARTUP_FAILURE)
        return
    metrics = SidecarServer(
        server_config(
            create_metrics_app(app),
            settings,
            app,
            host=settings.metrics_host or settings.host,
            port=settings.metrics_port,
            lifespan="off",
        )
    )
    asyncio.run(serve_both(api, metrics))


async def serve_both(api: uvicorn.Server, metrics: uvicorn.Server) -> None:
    metrics_task = asyncio.create_task(metrics.serve())
    try:
        await api.serve()
    finally:
        metrics.should_exit = True
        await metrics_task
