"""Serving an ASGI app on a real socket in a background thread (tests, the demo, benchmarks).

A real socket matters for what in-process ASGI transports cannot show, such as a client
disconnect closing a stream.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import uvicorn


def json_post_scope(path: str, body: bytes) -> dict[str, Any]:
    """The ASGI scope of a JSON ``POST`` to ``path`` carrying ``body``, as uvicorn would pass it:
    for driving an app in process, with no server in front."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
    }


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LiveServer:
    """An ASGI app served by uvicorn on a free port (or ``port``), in a daemon thread.

    ``LiveServer(app).start()`` ... ``.stop()``, or ``with LiveServer(app) as server:``.
    """

    def __init__(self, app: Any, port: int | None = None, *, host: str = "127.0.0.1", name: str = "server") -> None:
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.name = name
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning", access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=name, daemon=True)

    def start(self, timeout_s: float = 15.0) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                self._server.should_exit = True
                raise RuntimeError(f"{self.name} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


@contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", name: str = "server") -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL (no trailing slash)."""
    server = LiveServer(app, host=host, name=name).start()
    try:
        yield server.url
    finally:
        server.stop()
