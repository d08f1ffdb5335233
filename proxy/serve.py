"""Running the proxy under uvicorn: the API, and ``/metrics`` on its own address when configured.

Both servers bound how long a client may take to send its request (:mod:`proxy.http.inbound`):
uvicorn's HTTP protocol with header and request deadlines and a cap on requests still arriving,
and the app wrapped so that a read past the deadline is answered 408.

Their sockets are bound before anything else starts: an address another process holds is one line
naming the setting (:class:`ConfigError`, exit 2), as every configuration problem is. SIGTERM (or
SIGINT) drains: no new connection is accepted, requests in flight (streams included) finish, for up
to ``timeout_graceful_shutdown``; the drain's start and end are logged, and a drain that finished
exits 0 (one cut short by the timeout ends as the signal would, 143).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI
from uvicorn.config import STARTUP_FAILURE

from proxy.app import create_app, create_metrics_app
from proxy.config import Settings, bound_socket
from proxy.config_sources import ConfigError
from proxy.http import InboundLimits, ReadDeadline, deadline_protocol

SERVER_OPTIONS: dict[str, Any] = {"log_level": "warning", "access_log": False, "timeout_graceful_shutdown": 30}

logger = logging.getLogger("prefix_proxy.serve")


class ProxyServer(uvicorn.Server):
    """The API server: it handles the signals, logs the drain they start and how it ended, and
    exits 0 after a drain that finished."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stop_signal: str | None = None
        self.drained = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: no logging here (the drain is logged from the loop, in shutdown).
        if self.stop_signal is None:
            self.stop_signal = signal.Signals(sig).name
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self.server_state
        fields = {"event": "draining", "signal": self.stop_signal, "connections": len(state.connections)}
        fields["requests"] = len(state.tasks)
        fields["timeout_s"] = self.config.timeout_graceful_shutdown
        logger.info("draining", extra={"fields": fields})
        started = time.monotonic()
        await super().shutdown(sockets)
        seconds = time.monotonic() - started
        limit = self.config.timeout_graceful_shutdown
        self.drained = not self.force_exit and (limit is None or seconds < limit)
        stopped = {"event": "stopped", "drained": self.drained, "seconds": round(seconds, 3)}
        if self.drained:
            logger.info("stopped", extra={"fields": stopped})
        else:
            logger.warning("stopped before every request finished", extra={"fields": stopped})

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            if self.drained:
                # uvicorn raises the signal again once the server stopped (exit 143 on SIGTERM):
                # after a drain that finished, the process ends as one that did its work, 0.
                self._captured_signals.clear()


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


def listen(host: str, port: int, setting: str) -> socket.socket:
    """A socket bound to ``host``:``port`` as the settings' check bound it (``bound_socket``; the
    server listens on it once it starts); :class:`ConfigError` naming ``setting`` when it cannot be."""
    try:
        sock = bound_socket(host, port)
    except (socket.gaierror, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError([f"{setting}: cannot listen on {host}:{port}: {reason}: choose another host"]) from None
    except OSError as failure:
        reason = failure.strerror or str(failure)
        held = " (another process listens there): stop it, or" if failure.errno == errno.EADDRINUSE else ":"
        raise ConfigError(
            [f"{setting}: cannot listen on {host}:{port}: {reason}{held} choose another {setting}"]
        ) from None
    sock.set_inheritable(True)
    return sock


@dataclass
class Servers:
    """What ``serve`` runs: the proxy app, the API server, the ``/metrics`` server when
    ``metrics_port`` is set, and the sockets they listen on (bound, not yet accepting)."""

    app: FastAPI
    api: ProxyServer
    metrics: SidecarServer | None
    sockets: list[socket.socket]

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT (or ``api.should_exit``)."""
        if self.metrics is None:
            # As uvicorn.run: Ctrl-C is a way to stop.
            with contextlib.suppress(KeyboardInterrupt):
                self.api.run(sockets=self.sockets)
            return
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_both(self.api, self.metrics, self.sockets))


def build_servers(settings: Settings, *, reload: Callable[[], Settings] | None = None) -> Servers:
    """The servers ``serve`` runs for ``settings``: the addresses bound first (:class:`ConfigError`
    naming the setting when one cannot be), then the app built."""
    sockets = [listen(settings.host, settings.port, "port")]
    if settings.metrics_port is not None:
        try:
            sockets.append(listen(settings.metrics_host or settings.host, settings.metrics_port, "metrics_port"))
        except ConfigError:
            sockets[0].close()
            raise
    try:
        app = create_app(settings, reload=reload)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    api = ProxyServer(server_config(app, settings, app, host=settings.host, port=settings.port))
    metrics = None
    if settings.metrics_port is not None:
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
    return Servers(app, api, metrics, sockets)


def serve(settings: Settings, *, reload: Callable[[], Settings] | None = None) -> None:
    """Serve until SIGTERM or SIGINT; SIGHUP calls ``reload`` and applies what it can (proxy.reload)."""
    servers = build_servers(settings, reload=reload)
    # Everything built so far (modules, settings, the app) lives as long as the process:
    # out of the collector's sight, a full collection walks only what requests leave behind.
    gc.freeze()
    servers.run()
    if servers.metrics is None and not servers.api.started:
        # As uvicorn.run: a server that could not start exits 3.
        sys.exit(STARTUP_FAILURE)


async def serve_both(api: uvicorn.Server, metrics: uvicorn.Server, sockets: list[socket.socket]) -> None:
    metrics_task = asyncio.create_task(metrics.serve(sockets=sockets[1:]))
    try:
        await api.serve(sockets=sockets[:1])
    finally:
        metrics.should_exit = True
        await metrics_task
