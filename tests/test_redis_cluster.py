"""The session store on a real Redis Cluster of our own: proxy processes sharing it, and a master
really stopped under traffic while its replica is promoted."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import redis

from proxy.chat.budget import usage_limits
from proxy.config import BudgetSettings
from proxy.sessions.store import window_of
from tests.helpers import ProxyProcess, chat
from tests.redis_server import PrivateCluster
from tests.test_redis_e2e import ADMIN, SYSTEM

PREFIX = "pp-cluster:"
TENANT_LIMIT = 10**9


def cluster_env(cluster: PrivateCluster, **extra: str) -> dict[str, str]:
    return {
        "PREFIX_PROXY_SESSIONS__STORE": "redis",
        "PREFIX_PROXY_SESSIONS__REDIS_URL": cluster.url,  # one node: the seed
        "PREFIX_PROXY_SESSIONS__REDIS_CLUSTER": "true",
        "PREFIX_PROXY_SESSIONS__KEY_PREFIX": PREFIX,
        "PREFIX_PROXY_ADMIN_API_KEY": "admin-key",
        **extra,
    }


def shared_entries(url: str, direction: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    prefix = f'prefix_proxy_shared_memory_entries_total{{direction="{direction}"}} '
    return sum(float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix))


def tenant_usage_key(tenant: str = "anonymous") -> str:
    budget = BudgetSettings(tenant_tokens_per_window=TENANT_LIMIT)
    limit = usage_limits(budget, tenant, None)[0]
    return f"{PREFIX}u:{limit.key}:{window_of(time.time(), budget.window_s)[0]}"


def test_two_proxy_processes_share_sessions_and_budgets_on_a_cluster(
    start_proxies: Callable[..., list[ProxyProcess]],
) -> None:
    cluster = PrivateCluster(masters=3).start()
    try:
        env = cluster_env(
            cluster,
            PREFIX_PROXY_BUDGET__SESSION_TOKENS_PER_WINDOW="2500",
            PREFIX_PROXY_BUDGET__TENANT_TOKENS_PER_WINDOW=str(TENANT_LIMIT),
            PREFIX_PROXY_REPLICAS__SHARE_MEMORIES="true",
        )
        a, b = start_proxies(2, env)
        # One inferred conversation alternating between the replicas: one session, counted exactly.
        history: list[dict[str, Any]] = [SYSTEM]
        sessions, spent = set(), 0
        for turn in range(6):
            history.append({"role": "user", "content": f"Question {turn}: which screws fit a 6 mm plug?"})
            response = chat((a, b)[turn % 2].url, history, max_tokens=20)
            assert response.status_code == 200, response.text
            assert "x-prefix-proxy-session" in response.headers, "the store answered (no pass-through)"
            sessions.add(response.headers["x-prefix-proxy-session"])
            spent += response.json()["usage"]["total_tokens"]
            history.append(response.json()["choices"][0]["message"])
        assert len(sessions) == 1
        session_id = sessions.pop()
        for replica in (a, b):
            record = httpx.get(f"{replica.url}/admin/tenants/anonymous/sessions/{session_id}", headers=ADMIN).json()
            assert record["requests"] == 6
            assert record["budget_left"]["session"] == 2500 - spent

        # A burst on one named session over both replicas: admission is one atomic script on the
        # slot of the tenant's tag, so the session limit holds and the tenant counter sees it all.
        def one(i: int) -> httpx.Response:
            messages = [SYSTEM, {"role": "user", "content": f"Request {i}: list three kinds of wood glue."}]
            return chat((a, b)[i % 2].url, messages, headers={"x-session-id": "burst"}, max_tokens=20)

        with concurrent.futures.ThreadPoolExecutor(30) as pool:
            responses = list(pool.map(one, range(30)))
        admitted = [r for r in responses if r.status_code == 200]
        assert admitted and len(admitted) + sum(r.status_code == 429 for r in responses) == 30
        burst = sum(r.json()["usage"]["total_tokens"] for r in admitted)
        assert burst <= 2500
        tenant_used = int(cluster.client().get(tenant_usage_key()) or 0)
        assert tenant_used == spent + burst, "every admission was settled to the real usage on the cluster"
        # The replicas' shared memories travel through the cluster too (one stream key): what each
        # replica learned reached the other.
        time.sleep(0.5)
        published = [shared_entries(replica.url, "published") for replica in (a, b)]
        applied = [shared_entries(replica.url, "applied") for replica in (a, b)]
        assert sum(published) > 0 and applied == published[::-1]
    finally:
        cluster.stop()


def test_a_master_fails_over_under_traffic_without_losing_budget_or_requests(
    start_proxies: Callable[..., list[ProxyProcess]],
) -> None:
    cluster = PrivateCluster(masters=3, replicas=1).start()
    try:
        env = cluster_env(
            cluster,
            PREFIX_PROXY_BUDGET__TENANT_TOKENS_PER_WINDOW=str(TENANT_LIMIT),
            PREFIX_PROXY_SESSIONS__RETRY_AFTER_FAILURE_S="0.3",
        )
        proxies = start_proxies(2, env)
        key = tenant_usage_key()
        stop = threading.Event()
        outcomes: list[tuple[int, bool]] = []  # (status, served with sessions and budgets)

        def conversation(worker: int) -> None:
            history: list[dict[str, Any]] = [SYSTEM]
            turn = 0
            while not stop.is_set():
                if len(history) > 9:
                    history = [SYSTEM]
                history.append({"role": "user", "content": f"Worker {worker} turn {turn}: what glue for oak?"})
                try:
                    response = chat(
                        proxies[turn % 2].url, history, headers={"x-session-id": f"w{worker}"}, max_tokens=20
                    )
                    outcomes.append((response.status_code, "x-prefix-proxy-session" in response.headers))
                    if response.status_code == 200:
                        history.append(response.json()["choices"][0]["message"])
                    else:
                        history.pop()
                except httpx.HTTPError:
                    outcomes.append((0, False))
                turn += 1

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            workers = [pool.submit(conversation, w) for w in range(4)]
            time.sleep(3)
            before = int(cluster.client().get(key) or 0)
            requests_before = len(outcomes)
            assert before > 0 and requests_before > 0
            master = cluster.master_of(key)
            started = time.monotonic()
            promoted = cluster.fail_over(master)
            failover_s = time.monotonic() - started
            time.sleep(3)  # traffic on the promoted replica
            stop.set()
            for worker in workers:
                worker.result()
        after = int(redis.Redis(port=promoted.port).get(key) or 0)
        statuses = [status for status, _ in outcomes]
        degraded = sum(not counted for _, counted in outcomes)
        print(
            f"\ncluster failover: {len(outcomes)} requests ({requests_before} before the stop), "
            f"{sum(s != 200 for s in statuses)} failed, {degraded} served in pass-through; "
            f"replica promoted in {failover_s:.1f} s; tenant budget used {before} before, {after} after"
        )
        assert all(status == 200 for status in statuses), "no request failed"
        assert after > before, "nothing counted before the failover was lost, and counting resumed"
        assert outcomes[-1][1], "the store is back: the last requests were counted again"
    finally:
        cluster.stop()
