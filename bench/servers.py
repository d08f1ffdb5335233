"""Start the fake backend and the proxy as real processes on free ports, for benchmarks."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become ready")


@contextlib.contextmanager
def process(args: Sequence[str], ready_url: str, env: dict[str, str] | None = None) -> Iterator[None]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(ready_url, proc)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def fake_backend(*extra: str) -> Iterator[str]:
    """Yields the backend's /v1 base URL."""
    port = free_port()
    with process(["fake-backend", "--port", str(port), *extra], f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}/v1"


@contextlib.contextmanager
def proxy(upstream: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Yields the proxy's /v1 base URL."""
    port = free_port()
    # Default settings, access log included (to /dev/null): the figures are what a deployment gets.
    with process(["serve", "--upstream", upstream, "--port", str(port)], f"http://127.0.0.1:{port}/healthz", env):
        yield f"http://127.0.0.1:{port}/v1"
