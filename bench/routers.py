"""Hit rate through an external KV-aware router, with and without the proxy in front of it.

    python -m bench.routers [--backends 3] [--sessions 8] [--concurrency 8]

The project's workload runs against N fresh fake vLLM backends (vLLM-faithful prefix caches):

- one backend (the ceiling: one shared cache);
- the proxy's own affinity routing over the N backends (the reference);
- the proxy in front of vLLM Router (``consistent_hash``, fed ``routing.key_headers: [x-session-id]``;
  ``cache_aware``, fed canonical prompts only), and in front of the SGLang Model Gateway
  (``consistent_hashing`` with ``--routing-key-headers x-smg-routing-key``);
- each router alone, on the raw client traffic;
- the proxy + vLLM Router ``consistent_hash`` with one backend stopped halfway through.

Reported: requests (errors), hit rate and prefill tokens as the backends' usage reports them.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.servers import free_port
from proxy.app import create_app
from proxy.config import Settings
from testbed.demo import DEMO_MAX_MODEL_LEN
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_backend
from testbed.serving import serve_in_thread
from testbed.workload import ScenarioResult, overall, run_workload

# What each router reads its routing key from, as the proxy is told to send it.
VLLM_ROUTER_KEY_HEADER = "x-session-id"  # consistent_hash's first choice (then x-user-id, ...)
SMG_KEY_HEADER = "x-smg-routing-key"


def router_executable(command: str) -> str | None:
    """On PATH, or next to this Python (a virtual environment that is not activated)."""
    beside = Path(sys.executable).parent / command
    return shutil.which(command) or (str(beside) if beside.is_file() else None)


def router_available(command: str) -> bool:
    return router_executable(command) is not None


def _wait_routed(url: str, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Until the router answers /v1/models through a worker (workers register in the background)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"router exited with {process.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"router at {url} did not become ready")


@contextlib.contextmanager
def _router_process(args: list[str], port: int) -> Iterator[str]:
    args = [router_executable(args[0]) or args[0], *args[1:]]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_routed(url, process)
        yield url
    finally:
        # By its pid: the router renames its process (setproctitle), so no name would find it.
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def vllm_router(
    workers: Sequence[str], policy: str = "consistent_hash", health_check_interval_s: int = 2
) -> Iterator[str]:
    """A ``vllm-router`` process over ``workers`` (server roots, no /v1); yields its root URL.

    Health checks as for :func:`smg_router` (a CI run once saw every conversation on one backend).
    """
    port = free_port()
    args = [
        *("vllm-router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy),
        *("--worker-urls", *workers),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
        *("--health-check-interval-secs", str(health_check_interval_s), "--log-level", "warning"),
    ]
    with _router_process(args, port) as url:
        _wait_registered(url, len(workers))
        yield url


@contextlib.contextmanager
def smg_router(
    workers: Sequence[str],
    policy: str = "consistent_hashing",
    key_headers: Sequence[str] = (SMG_KEY_HEADER,),
    health_check_interval_s: int = 2,
) -> Iterator[str]:
    """An ``smg launch`` process (SGLang Model Gateway) over ``workers``; yields its root URL.

    Frequent health checks notice a killed backend soon (the bench); on a loaded machine they can
    also drop a live one for a moment, which moves conversations on the ring (tests pass a long one).
    """
    port = free_port()
    args = [
        *("smg", "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy),
        *("--worker-urls", *workers),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
        *("--disable-tokenizer-autoload", "--health-check-interval-secs", str(health_check_interval_s)),
        *("--log-level", "warn"),
    ]
    if key_headers:
        args += ["--routing-key-headers", *key_headers]
    with _router_process(args, port) as url:
        _wait_registered(url, len(workers))
        yield url


def _wait_registered(url: str, count: int, timeout: float = 60.0) -> None:
    """Until the router lists every worker as healthy (both register them in the background; requests
    before that would all hash onto the ring of the first one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            workers = httpx.get(url + "/workers", timeout=2).json().get("workers", [])
            if sum(1 for worker in workers if worker.get("is_healthy", True)) >= count:
                return
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"router at {url} did not register {count} healthy workers")


@dataclass
class RouterRun:
    label: str
    totals: ScenarioResult
    per_backend: list[int]
    # A backend was stopped mid-run: the requests it had already been sent may fail (docs/routing.md).
    lost_backend: bool = False

    def failed(self, concurrency: int) -> bool:
        """More failures than the run allows: none, or at most one per client when a backend was lost."""
        return self.totals.errors > (concurrency if self.lost_backend else 0)

    def cells(self, ceiling: ScenarioResult) -> list[str]:
        """Its table cells after the label: requests (errors), hit rate, prefill tokens, prefill
        against ``ceiling`` (one backend), requests per backend."""
        totals = self.totals
        ratio = totals.prefill_tokens / ceiling.prefill_tokens if ceiling.prefill_tokens else 0.0
        per_backend = " / ".join(str(c) for c in self.per_backend)
        return [
            f"{totals.requests} ({totals.errors})",
            f"{totals.hit_rate:.1%}",
            f"{totals.prefill_tokens:,}",
            f"{ratio:.2f}x",
            per_backend,
        ]


def requests_seen(urls: Sequence[str]) -> list[int]:
    counts = []
    for url in urls:
        try:
            counts.append(int(httpx.get(url + "/fake/stats", timeout=5).json()["prefix_cache"]["requests"]))
        except httpx.HTTPError:
            counts.append(0)
    return counts


# How one configuration reaches the backends: given their root URLs, yields the base URL clients use.
Front = Callable[[list[str]], contextlib.AbstractContextManager[str]]
# A router over the backends' root URLs: yields its own root URL.
Router = Callable[[list[str]], contextlib.AbstractContextManager[str]]


@contextlib.contextmanager
def through_proxy(upstreams: list[str], **settings: object) -> Iterator[str]:
    app = create_app(Settings(upstreams=[u + "/v1" for u in upstreams], **settings))  # type: ignore[arg-type]
    with serve_in_thread(app, name="prefix-proxy") as url:
        yield url + "/v1"


def proxy_affinity(backends: list[str]) -> contextlib.AbstractContextManager[str]:
    return through_proxy(backends)


@contextlib.contextmanager
def proxy_then(router: Router, backends: list[str], **settings: object) -> Iterator[str]:
    with router(backends) as router_url, through_proxy([router_url], **settings) as url:
        yield url


@contextlib.contextmanager
def router_alone(router: Router, backends: list[str]) -> Iterator[str]:
    with router(backends) as router_url:
        yield router_url + "/v1"


def run_front(
    label: str,
    front: Front,
    backends: int,
    *,
    sessions: int,
    concurrency: int,
    seed: int,
    scenarios: Sequence[str] | None = None,
    lose_one_halfway: bool = False,
) -> RouterRun:
    config = FakeBackendConfig(max_model_len=DEMO_MAX_MODEL_LEN)
    with ExitStack() as stack:
        servers = [ExitStack() for _ in range(backends)]
        urls = [
            server.enter_context(serve_in_thread(create_fake_backend(config), name=f"fake-{i}"))
            for i, server in enumerate(servers)
        ]
        for server in servers:
            stack.callback(server.close)
        base_url = stack.enter_context(front(urls))
        counts_before_loss: list[int] = []
        progress: Callable[[int, int], None] | None = None
        if lose_one_halfway:
            lost = threading.Event()

            def progress(done: int, expected: int) -> None:
                if done >= expected // 2 and not lost.is_set():
                    lost.set()
                    counts_before_loss.extend(requests_seen(urls))
                    threading.Thread(target=servers[-1].close, daemon=True).start()

        results = run_workload(
            base_url, scenarios, sessions_per_scenario=sessions, seed=seed, concurrency=concurrency, progress=progress
        )
        per_backend = requests_seen(urls)
        if lose_one_halfway:
            per_backend[-1] = counts_before_loss[-1]
    return RouterRun(label, overall(results.values()), per_backend, lose_one_halfway)


def table(runs: list[RouterRun]) -> str:
    ceiling = runs[0].totals
    lines = [
        "| configuration | requests (errors) | hit rate | prefill tokens | vs one backend | requests per backend |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {' | '.join([run.label, *run.cells(ceiling)])} |" for run in runs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routers", description=__doc__)
    parser.add_argument("--backends", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=8, help="sessions per scenario")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    options = {"sessions": args.sessions, "concurrency": args.concurrency, "seed": args.seed}
    n = args.backends
    keyed = {"routing": {"key_headers": [VLLM_ROUTER_KEY_HEADER]}}
    smg_keyed = {"routing": {"key_headers": [SMG_KEY_HEADER]}}

    def vllm(policy: str) -> Router:
        return lambda backends: vllm_router(backends, policy)

    def smg(policy: str) -> Router:
        return lambda backends: smg_router(backends, policy)

    runs = [
        run_front("one backend, proxy (ceiling)", proxy_affinity, 1, **options),
        run_front("proxy affinity", proxy_affinity, n, **options),
    ]
    if router_available("vllm-router"):
        runs += [
            run_front(
                "proxy + vllm-router consistent_hash (key header)",
                lambda b: proxy_then(vllm("consistent_hash"), b, **keyed),
                n,
                **options,
            ),
            run_front(
                "proxy + vllm-router consistent_hash (no key header)",
                lambda b: proxy_then(vllm("consistent_hash"), b),
                n,
                **options,
            ),
            run_front("proxy + vllm-router cache_aware", lambda b: proxy_then(vllm("cache_aware"), b), n, **options),
            run_front(
                "vllm-router consistent_hash alone", lambda b: router_alone(vllm("consistent_hash"), b), n, **options
            ),
            run_front("vllm-router cache_aware alone", lambda b: router_alone(vllm("cache_aware"), b), n, **options),
            run_front(
                "proxy + vllm-router consistent_hash, one backend lost halfway",
                lambda b: proxy_then(vllm("consistent_hash"), b, **keyed),
                n,
                lose_one_halfway=True,
                **options,
            ),
        ]
    else:
        print("vllm-router is not installed (pip install vllm-router): its rows are left out")
    if router_available("smg"):
        runs += [
            run_front(
                "proxy + smg consistent_hashing (key header)",
                lambda b: proxy_then(smg("consistent_hashing"), b, **smg_keyed),
                n,
                **options,
            ),
            run_front("smg cache_aware alone", lambda b: router_alone(smg("cache_aware"), b), n, **options),
            run_front("proxy + smg cache_aware", lambda b: proxy_then(smg("cache_aware"), b), n, **options),
        ]
    else:
        print("smg is not installed (pip install smg): its rows are left out")
    print(table(runs))
    return 1 if any(run.failed(args.concurrency) for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
