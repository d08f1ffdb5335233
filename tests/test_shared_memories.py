"""Replicas that agree: what one proxy replica's canonicalizer learns reaches the others through
Redis (``replicas.share_memories``), so a round-robin load balancer costs no cache hits."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.config import CanonSettings, Settings
from proxy.replicas.memories import Journal, SharedCanonicalizer
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from testbed.workload import overall, run_workload
from tests.helpers import LiveServer
from tests.redis_server import SHARED_URL

SCENARIOS = ["dify_rag", "fc_agent", "timestamp_user", "sliding_window"]


class RoundRobin(httpx.AsyncBaseTransport):
    """What a round-robin load balancer does: each request to the next replica, whatever it is."""

    def __init__(self, ports: list[int]) -> None:
        self._ports = itertools.cycle(ports)
        self._inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(port=next(self._ports))
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


@pytest.fixture(scope="module")
def backend() -> Iterator[LiveServer]:
    server = LiveServer(create_fake_app(FakeBackendConfig(max_model_len=16384))).start()
    yield server
    server.stop()


def replicas_prefill(backend: LiveServer, replicas: int, share: bool, prefix: str) -> tuple[int, float, int]:
    """(prefill tokens, hit rate, errors) of the workload through ``replicas`` proxies, round robin."""
    httpx.post(backend.url + "/fake/reset", timeout=10)
    settings = Settings(
        upstream=backend.url + "/v1",
        sessions={"store": "redis", "redis_url": SHARED_URL, "key_prefix": prefix},
        replicas={"share_memories": share},
    )
    servers = [LiveServer(create_app(settings)).start() for _ in range(replicas)]
    try:
        time.sleep(0.2)  # the feeds' first reads
        transport = RoundRobin([s.port for s in servers])
        results = run_workload(
            servers[0].url + "/v1", SCENARIOS, sessions_per_scenario=3, seed=1, concurrency=4, transport=transport
        )
    finally:
        for server in servers:
            server.stop()
    totals = overall(results.values())
    return totals.prefill_tokens, totals.hit_rate, totals.errors


def test_three_replicas_sharing_memories_compute_what_one_replica_computes(
    backend: LiveServer, redis_prefix: str
) -> None:
    one, one_rate, errors_one = replicas_prefill(backend, 1, False, redis_prefix + "one:")
    alone, alone_rate, errors_alone = replicas_prefill(backend, 3, False, redis_prefix + "alone:")
    shared, shared_rate, errors_shared = replicas_prefill(backend, 3, True, redis_prefix + "shared:")
    print(
        f"\n1 replica: {one:,} prefill ({one_rate:.1%}); 3 learning alone: {alone:,} ({alone_rate:.1%}); "
        f"3 sharing: {shared:,} ({shared_rate:.1%})"
    )
    assert errors_one == errors_alone == errors_shared == 0
    assert alone > one * 1.1, "the control: replicas that learn alone lose hits behind round robin"
    assert shared <= one * 1.03, "sharing replicas compute (about) what one replica computes"


def test_entries_from_another_replica_are_applied_and_never_journaled_again() -> None:
    origin_journal, other_journal = Journal(), Journal()
    origin = SharedCanonicalizer(CanonSettings(), origin_journal)
    other = SharedCanonicalizer(CanonSettings(), other_journal)
    system = "You are the shop's assistant.\nToday is 2026-11-30.\nAnswer briefly."
    for day in ("2026-11-29", "2026-11-30"):
        body: dict[str, Any] = {
            "model": "m",
            "messages": [
                {"role": "system", "content": system.replace("2026-11-30", day)},
                {"role": "user", "content": f"hi on {day}"},
            ],
        }
        origin.apply(body, "t")
    origin.keep_structure("strict-model")
    entries = origin_journal.drain()
    assert {e[0] for e in entries} >= {"L", "V", "P", "S"}
    assert other.apply_entries(entries) == len(entries)
    assert other_journal.entries == [], "what another replica learned is not sent back"
    assert other.keeps_structure("strict-model")
    # The other replica now moves the date at first sight: the place has varied (on the origin).
    messages = [{"role": "system", "content": system.replace("30", "28")}, {"role": "user", "content": "x"}]
    moved = other.apply({"model": "m", "messages": messages}, "t")
    assert any(a.kind.startswith("volatile") or "moved" in a.kind for a in moved.actions), moved.actions
    assert other.apply_entries([["?"], ["V", "bad"], "junk"]) == 0, "unknown or malformed entries are skipped"
