"""Several proxy replicas behind a real round-robin load balancer (haproxy): learning alone vs sharing.

    python -m bench.replicas [--replicas 3] [--sessions 8] [--concurrency 8]

The project's workload goes through haproxy (``balance roundrobin``: each request to the next
replica, whatever conversation it belongs to) to N proxy processes on one Redis, all forwarding to
one fresh fake vLLM backend. Three runs: one replica (the reference), N replicas that each learn
alone (``replicas.share_memories: false``), N replicas sharing what they learn. Reported: hit rate
and prefill tokens as the backend's usage reports them, and errors. Needs haproxy
(``apt-get install haproxy``) and Redis on 127.0.0.1:6379.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import redis

from bench.servers import fake_backend, free_port, proxy
from testbed.demo import DEMO_MAX_MODEL_LEN
from testbed.workload import ScenarioResult, overall, run_workload

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


@contextlib.contextmanager
def haproxy(backends: list[str]) -> Iterator[str]:
    """haproxy in HTTP mode, round robin over ``backends`` (``http://host:port`` each); yields its URL."""
    if shutil.which("haproxy") is None:
        raise SystemExit("haproxy is not installed (apt-get install haproxy)")
    port = free_port()
    servers = "\n".join(
        f"    server r{i} {url.removeprefix('http://')} check inter 1s" for i, url in enumerate(backends)
    )
    config = f"""global
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    option http-keep-alive
frontend proxies
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /healthz
{servers}
"""
    directory = Path(tempfile.mkdtemp(prefix="pp-haproxy-"))
    (directory / "haproxy.cfg").write_text(config)
    process = subprocess.Popen(
        ["haproxy", "-f", str(directory / "haproxy.cfg"), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("haproxy did not start")
            time.sleep(0.1)
        time.sleep(2.5)  # every replica passes its first health check, so the rotation covers all
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


def run(replicas: int, share: bool, *, sessions: int, concurrency: int, seed: int) -> ScenarioResult:
    prefix = f"ppbench:{uuid.uuid4().hex[:8]}:"
    env = {
        "PREFIX_PROXY_SESSIONS__STORE": "redis",
        "PREFIX_PROXY_SESSIONS__REDIS_URL": REDIS_URL,
        "PREFIX_PROXY_SESSIONS__KEY_PREFIX": prefix,
        "PREFIX_PROXY_REPLICAS__SHARE_MEMORIES": "true" if share else "false",
    }
    try:
        with ExitStack() as stack:
            backend = stack.enter_context(fake_backend("--max-model-len", str(DEMO_MAX_MODEL_LEN)))
            urls = [stack.enter_context(proxy(backend, env)).removesuffix("/v1") for _ in range(replicas)]
            balancer = stack.enter_context(haproxy(urls))
            results = run_workload(
                balancer + "/v1", None, sessions_per_scenario=sessions, seed=seed, concurrency=concurrency
            )
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    return overall(results.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=8, help="sessions per scenario")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    options = {"sessions": args.sessions, "concurrency": args.concurrency, "seed": args.seed}
    runs = [
        ("1 replica", run(1, False, **options)),
        (f"{args.replicas} replicas, each learning alone", run(args.replicas, False, **options)),
        (f"{args.replicas} replicas sharing memories", run(args.replicas, True, **options)),
    ]
    reference = runs[0][1].prefill_tokens
    print("| behind haproxy (round robin) | requests (errors) | hit rate | prefill tokens | vs 1 replica |")
    print("| --- | --- | --- | --- | --- |")
    for label, totals in runs:
        ratio = totals.prefill_tokens / reference if reference else 0.0
        print(
            f"| {label} | {totals.requests} ({totals.errors}) | {totals.hit_rate:.1%} | "
            f"{totals.prefill_tokens:,} | {ratio:.2f}x |"
        )
    return 1 if any(totals.errors for _, totals in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
