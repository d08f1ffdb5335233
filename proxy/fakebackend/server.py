"""Running the fake backend: in the foreground (CLI) or on a background thread (tests)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from proxy.fakebackend.app import create_app
from proxy.fakebackend.config import FakeBackendConfig


def serve(config: FakeBackendConfig, host: str, port: int, *, log_level: str = "warning") -> None:
    """Serve until interrupted (what ``prefix-proxy fake-backend`` runs)."""
    uvicorn.run(create_app(config), host=host, port=port, log_level=log_level)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def running_fake_backend(
    config: FakeBackendConfig | None = None, host: str = "127.0.0.1", port: int | None = None
) -> Iterator[str]:
    """A real uvicorn server on a background thread; yields its base URL (no trailing slash).

    A real socket matters for what ASGI transports in tests cannot show, such as a client
    disconnect closing a stream.
    """
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host=host, port=port or free_port(host), log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="fake-backend", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the fake backend did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
