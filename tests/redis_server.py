"""Real Redis servers for tests: the shared one on 6379, or a private one we may stop and start."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

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

    def __init__(self, port: int, *args: str) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._args = args  # e.g. ("--replicaof", "127.0.0.1", "6380")
        # A replica writes the RDB it receives to its working directory, and any redis-server loads
        # a dump.rdb it finds there at start: each server gets a directory of its own.
        self._dir = tempfile.mkdtemp(prefix="pp-redis-")
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateRedis:
        self._process = subprocess.Popen(
            [
                "redis-server",
                *("--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
                *("--dir", self._dir),
                *self._args,
            ],
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


class PrivateSentinel:
    """A Redis Sentinel of our own (``redis-server --sentinel``) watching one master, quick to fail over."""

    def __init__(self, port: int, directory: Path, master_port: int, service: str = "pp-test") -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.service = service
        self._config = directory / f"sentinel-{port}.conf"
        self._master_port = master_port
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateSentinel:
        # Sentinel rewrites its configuration file, so it gets a writable one of its own.
        self._config.write_text(
            f"port {self.port}\nbind 127.0.0.1\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self._master_port} 1\n"
            f"sentinel down-after-milliseconds {self.service} 1000\n"
            f"sentinel failover-timeout {self.service} 5000\n"
        )
        self._process = subprocess.Popen(
            ["redis-server", str(self._config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.master_port() == self._master_port:
                    return self
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise RuntimeError("private redis sentinel did not start")

    def master_port(self) -> int:
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        address = client.execute_command("SENTINEL", "get-master-addr-by-name", self.service)
        return int(address[1])

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None
