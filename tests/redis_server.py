"""Real Redis servers for tests: the shared one on 6379, or a private one we may stop and start."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid

import pytest
import redis

SHARED_URL = "redis://127.0.0.1:6379/0"


def require_shared_redis() -> None:
    try:
        redis.Redis.from_url(SHARED_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis must run on 127.0.0.1:6379 for these tests (.ci/run starts it): {exc}")


def unique_prefix() -> str:
    return f"pptest:{uuid.uuid4().hex[:12]}:"


def delete_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)


class PrivateRedis:
    """A redis-server process of our own on a free port, which a test may really stop and restart."""

    def __init__(self, port: int) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateRedis:
        self._process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.2).ping()
                return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None
