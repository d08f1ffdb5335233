"""Shared fixtures: real servers on real ports (uvicorn) for end-to-end tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from proxy.app import create_app
from proxy.config import Settings
from proxy.fakebackend import FakeBackendConfig
from proxy.fakebackend import create_app as create_fake_app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    """An ASGI app served by uvicorn on a free port, in a background thread."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


@pytest.fixture(scope="session")
def fake_backend() -> Iterator[LiveServer]:
    server = LiveServer(create_fake_app(FakeBackendConfig())).start()
    yield server
    server.stop()


@pytest.fixture
def make_proxy(fake_backend: LiveServer) -> Iterator[Callable[..., LiveServer]]:
    started: list[LiveServer] = []

    def make(**overrides: Any) -> LiveServer:
        overrides.setdefault("upstream", fake_backend.url + "/v1")
        server = LiveServer(create_app(Settings(**overrides))).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def proxy(make_proxy: Callable[..., LiveServer]) -> LiveServer:
    return make_proxy()


@pytest.fixture
def fake_stats(fake_backend: LiveServer) -> Callable[[], dict[str, Any]]:
    def stats() -> dict[str, Any]:
        return dict(httpx.get(fake_backend.url + "/fake/stats").json())

    return stats
