"""Running the proxy under uvicorn: the API, and ``/metrics`` on its own address when configured."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import uvicorn

from proxy.app import create_app, create_metrics_app
from proxy.config import Settings

SERVER_OPTIONS: dict[str, Any] = {"log_level": "warning", "access_log": False, "timeout_graceful_shutdown": 30}


class SidecarServer(uvicorn.Server):
    """A second server in the process: the API server handles the signals, this one stops with it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def serve(settings: Settings) -> None:
    app = create_app(settings)
    # Everything built so far (modules, settings, the app) lives as long as the process:
    # out of the collector's sight, a full collection walks only what requests leave behind.
    gc.freeze()
    if settings.metrics_port is None:
        uvicorn.run(app, host=settings.host, port=settings.port, **SERVER_OPTIONS)
        return
    api = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, **SERVER_OPTIONS))
    metrics = SidecarServer(
        uvicorn.Config(
            create_metrics_app(app),
            host=settings.metrics_host or settings.host,
            port=settings.metrics_port,
            lifespan="off",
            **SERVER_OPTIONS,
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
