"""Real Redis servers for tests: the shared one on 6379, or a private one we may stop and start."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import redis

from tests.helpers import require_executable

SHARED_URL = "redis://127.0.0.1:6379/0"
REDIS_HINT = (
    "these tests start Redis servers of their own "
    "(Debian/Ubuntu: apt-get install redis-server; bash scripts/test.sh installs it)"
)


def require_shared_redis() -> None:
    try:
        redis.Redis.from_url(SHARED_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis must run on 127.0.0.1:6379 for these tests (bash scripts/test.sh starts it): {exc}")


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
        require_executable("redis-server", REDIS_HINT)
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
            if self._paused:
                self.resume()
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None

    _paused = False

    def pause(self) -> None:
        """Stall the server (SIGSTOP): connections stay open, nothing is answered."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)
        self._paused = False


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


class PrivateCluster:
    """A Redis Cluster of our own: ``masters`` masters (the 16384 slots split between them), each
    with ``replicas`` replicas, every node a PrivateRedis (own port, own directory, really stoppable).

    Quick to fail over (``cluster-node-timeout`` 1 s): a stopped master's replica is promoted in a
    few seconds.
    """

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000) -> None:
        require_executable("redis-cli", REDIS_HINT)
        options = (
            *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
            *("--cluster-node-timeout", str(node_timeout_ms)),
            # A replica that lost its master for a while may still take over: the test wants the
            # failover, not the data-safety pause.
            *("--cluster-replica-validity-factor", "0"),
        )
        self.nodes = [PrivateRedis(_cluster_port(), *options) for _ in range(masters * (1 + replicas))]
        self._replicas = replicas

    @property
    def url(self) -> str:
        """Any node is a seed: the client discovers the others."""
        return self.nodes[0].url

    def start(self) -> PrivateCluster:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{node.port}" for node in self.nodes),
                    "--cluster-replicas",
                    str(self._replicas),
                    "--cluster-yes",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=60,
            )
            self.wait_ok(self.nodes)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, nodes: list[PrivateRedis], timeout: float = 30.0) -> None:
        """Until every given node sees the cluster whole (every slot served)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(
                    redis.Redis(port=n.port, socket_timeout=1).cluster("INFO").get("cluster_state") == "ok"
                    for n in nodes
                ):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the private Redis Cluster did not become ready")

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster.from_url(self.url, socket_timeout=2)

    def master_of(self, key: str) -> PrivateRedis:
        """The node serving ``key``'s slot as master now."""
        node = self.client().get_node_from_key(key)
        return next(n for n in self.nodes if n.port == node.port)

    def replica_of(self, master: PrivateRedis) -> PrivateRedis:
        # ROLE on a master: ["master", offset, [[host, port, offset], ...]]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            role = redis.Redis(port=master.port, socket_timeout=2).execute_command("ROLE")
            if role[2]:
                port = int(role[2][0][1])
                return next(n for n in self.nodes if n.port == port)
            time.sleep(0.1)
        raise AssertionError("the master has no replica")

    def fail_over(self, master: PrivateRedis, timeout: float = 30.0) -> PrivateRedis:
        """Stop ``master``; return its replica once promoted and the cluster whole again."""
        replica = self.replica_of(master)
        # Everything the master took is on the replica before it goes (WAIT), so the only losses a
        # test can see are the store's, not replication lag's.
        redis.Redis(port=master.port).execute_command("WAIT", 1, 5000)
        master.stop()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                role = redis.Redis(port=replica.port, socket_timeout=1).execute_command("ROLE")
                if role[0] in (b"master", "master"):
                    break
            except redis.RedisError:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError("the replica was not promoted")
        self.wait_ok([n for n in self.nodes if n is not master], timeout)
        return replica

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")
