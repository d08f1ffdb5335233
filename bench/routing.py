"""What routing over several backends does to the prefix-cache hit rate.

    python -m bench.routing [--backends 3] [--sessions 16] [--concurrency 8]

The project's workload goes through the proxy (default settings) to N fresh fake vLLM backends,
once per routing policy, and once more under ``affinity`` with one backend stopped halfway through.
A single backend carrying everything is the ceiling: no policy can beat one shared cache. Reported:
the hit rate the backends reported (usage), prefill tokens, the spread of requests over backends,
and failed requests.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import httpx

from proxy.app import create_app
from proxy.config import Settings
from proxy.demo import DEMO_MAX_MODEL_LEN, serve_in_thread
from proxy.fakebackend import FakeBackendConfig
from proxy.fakebackend import create_app as create_fake_backend
from proxy.workload import ScenarioResult, overall, run_workload


@dataclass
class RoutingRun:
    label: str
    backends: int
    totals: ScenarioResult
    per_backend: list[int]


def run_policy(
    label: str,
    policy: str,
    backends: int,
    *,
    sessions: int,
    concurrency: int,
    seed: int,
    scenarios: Sequence[str] | None = None,
    lose_one_halfway: bool = False,
) -> RoutingRun:
    config = FakeBackendConfig(max_model_len=DEMO_MAX_MODEL_LEN)
    with ExitStack() as stack:
        servers = [ExitStack() for _ in range(backends)]
        urls = [
            server.enter_context(serve_in_thread(create_fake_backend(config), name=f"fake-{i}"))
            for i, server in enumerate(servers)
        ]
        for server in servers:
            stack.callback(server.close)
        settings = Settings(upstreams=[u + "/v1" for u in urls], routing={"policy": policy})
        proxy_url = stack.enter_context(serve_in_thread(create_app(settings), name="prefix-proxy"))
        counts_before_loss: list[int] = []
        progress: Callable[[int, int], None] | None = None
        if lose_one_halfway:
            lost = threading.Event()

            def progress(done: int, expected: int) -> None:
                if done >= expected // 2 and not lost.is_set():
                    lost.set()
                    counts_before_loss.extend(_requests_seen(urls))
                    # Stopping waits for the server's thread: not on the workload's event loop.
                    threading.Thread(target=servers[-1].close, daemon=True).start()

        results = run_workload(
            proxy_url + "/v1",
            scenarios,
            sessions_per_scenario=sessions,
            seed=seed,
            concurrency=concurrency,
            progress=progress,
        )
        per_backend = _requests_seen(urls)
        if lose_one_halfway:
            per_backend[-1] = counts_before_loss[-1]
    return RoutingRun(label, backends, overall(results.values()), per_backend)


def _requests_seen(urls: list[str]) -> list[int]:
    counts = []
    for url in urls:
        try:
            counts.append(int(httpx.get(url + "/fake/stats", timeout=5).json()["prefix_cache"]["requests"]))
        except httpx.HTTPError:
            counts.append(0)
    return counts


def table(runs: list[RoutingRun]) -> str:
    ceiling = runs[0]
    lines = [
        "| routing | backends | requests (errors) | hit rate | prefill tokens | vs one backend "
        "| requests per backend |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        totals, best = run.totals, ceiling.totals
        ratio = totals.prefill_tokens / best.prefill_tokens if best.prefill_tokens else 0.0
        lines.append(
            f"| {run.label} | {run.backends} | {totals.requests} ({totals.errors}) | {totals.hit_rate:.1%} | "
            f"{totals.prefill_tokens:,} | {ratio:.2f}x | {' / '.join(str(c) for c in run.per_backend)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__)
    parser.add_argument("--backends", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=16, help="sessions per scenario")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    options = {"sessions": args.sessions, "concurrency": args.concurrency, "seed": args.seed}
    runs = [run_policy("one backend (ceiling)", "affinity", 1, **options)]
    for policy in ("affinity", "least_in_flight", "round_robin"):
        runs.append(run_policy(policy, policy, args.backends, **options))
    runs.append(
        run_policy("affinity, one backend lost halfway", "affinity", args.backends, lose_one_halfway=True, **options)
    )
    print(table(runs))
    return 1 if any(run.totals.errors for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
