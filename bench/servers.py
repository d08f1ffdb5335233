"""Start the fake backend and the proxy as real processes on free ports, for benchmarks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import IO

import httpx

from testbed.serving import free_port


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
def spawn(
    args: Sequence[str],
    ready_url: str,
    env: dict[str, str] | None = None,
    stderr: IO[bytes] | int = subprocess.DEVNULL,
    timeout: float = 30.0,
    cwd: str | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a command until the context exits, once ``ready_url`` answers."""
    proc = subprocess.Popen(
        list(args), env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=stderr, cwd=cwd
    )
    try:
        wait_ready(ready_url, proc, timeout)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def process(
    args: Sequence[str], ready_url: str, env: dict[str, str] | None = None, stderr: IO[bytes] | int = subprocess.DEVNULL
) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m proxy ARGS`` (the proxy's CLI) until the context exits."""
    with spawn([sys.executable, "-m", "proxy", *args], ready_url, env, stderr) as proc:
        yield proc


@contextlib.contextmanager
def fake_backend(*extra: str) -> Iterator[str]:
    """Yields the backend's /v1 base URL."""
    port = free_port()
    with process(["fake-backend", "--port", str(port), *extra], f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}/v1"


@contextlib.contextmanager
def proxy(
    upstream: str, env: dict[str, str] | None = None, stderr: IO[bytes] | int = subprocess.DEVNULL
) -> Iterator[str]:
    """Yields the proxy's /v1 base URL; its log goes to ``stderr``."""
    port = free_port()
    # Default settings, access log included (to /dev/null): the figures are what a deployment gets.
    with process(
        ["serve", "--upstream", upstream, "--port", str(port)], f"http://127.0.0.1:{port}/healthz", env, stderr
    ):
        yield f"http://127.0.0.1:{port}/v1"
