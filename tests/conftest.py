"""Shared fixtures: real servers on real ports (uvicorn) for end-to-end tests; helpers in tests/helpers.py."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.config import Settings
from proxy.observability.access_log import ACCESS_LOGGER, JsonFormatter
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer, ProxyProcess
from tests.redis_server import SHARED_URL, delete_prefix, require_shared_redis, unique_prefix


@pytest.fixture(scope="session")
def fake_backend() -> Iterator[LiveServer]:
    server = LiveServer(create_fake_app(FakeBackendConfig())).start()
    yield server
    server.stop()


@pytest.fixture
def make_proxy(fake_backend: LiveServer) -> Iterator[Callable[..., LiveServer]]:
    started: list[LiveServer] = []

    def make(**overrides: Any) -> LiveServer:
        if "upstreams" not in overrides:  # one of them (upstream beside upstreams is refused)
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


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    require_shared_redis()
    prefix = unique_prefix()
    yield prefix
    delete_prefix(SHARED_URL, prefix)


@pytest.fixture
def start_proxies(fake_backend: LiveServer) -> Iterator[Callable[..., list[ProxyProcess]]]:
    started: list[ProxyProcess] = []

    def start(count: int, env: dict[str, str]) -> list[ProxyProcess]:
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            procs = list(pool.map(lambda _: ProxyProcess(fake_backend.url + "/v1", env), range(count)))
        started.extend(procs)
        return procs

    yield start
    for proc in started:
        proc.stop()


class AccessLogCapture(logging.Handler):
    """The access log's lines, formatted as the proxy writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.setFormatter(JsonFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def access_lines() -> Iterator[list[str]]:
    """The access-log lines of the proxies a test runs in-process (at INFO whatever the level was)."""
    handler = AccessLogCapture()
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(previous)


@pytest.fixture(scope="module")
def stream_proxy() -> Iterator[LiveServer]:
    """A proxy with budgets in front of tests.stream_upstream's scripted engine (the stream tests)."""
    from tests.stream_upstream import budget_proxy

    proxy = budget_proxy()
    yield proxy
    proxy.stop()
