"""Fuzz the proxy with hostile HTTP (bench/hostile_http.py) behind an upstream that always answers.

    python -m bench.fuzz --requests 20000 [--seed 1] [--workers 8] [--redis-url redis://127.0.0.1:6379/0]

The proxy runs as a real process (``prefix-proxy serve``) with tenants, an admin key and budgets,
in front of ``bench/hostile_upstream.py`` in lenient mode (any model answered 200), so every 5xx is
the proxy's own. Reports the statuses seen; fails (exit 1) on any response >= 500, any error body
not in OpenAI's shape, or any ERROR line in the proxy's log. tests/test_fuzz.py runs the same
generator for a bounded number of requests in CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid

from bench.hostile_http import HostileHTTP, run
from bench.hostile_upstream import HostileUpstream
from bench.servers import proxy

API_KEYS = ["sk-acme-fuzz", "sk-globex-fuzz"]
ADMIN_KEY = "admin-fuzz"


def proxy_env(redis_url: str | None) -> dict[str, str]:
    env = {
        "PREFIX_PROXY_TENANTS": json.dumps(
            [{"name": "acme", "api_key": API_KEYS[0]}, {"name": "globex", "api_key": API_KEYS[1]}]
        ),
        "PREFIX_PROXY_ADMIN_API_KEY": ADMIN_KEY,
        "PREFIX_PROXY_BUDGET__SESSION_TOKENS_PER_WINDOW": "100000000",
        "PREFIX_PROXY_LOG_LEVEL": "info",
    }
    if redis_url:
        env["PREFIX_PROXY_SESSIONS__STORE"] = "redis"
        env["PREFIX_PROXY_SESSIONS__REDIS_URL"] = redis_url
        env["PREFIX_PROXY_SESSIONS__KEY_PREFIX"] = f"ppfuzz:{uuid.uuid4().hex[:8]}:"
    return env


def error_lines(log: bytes) -> list[str]:
    lines = log.decode("utf-8", "replace").splitlines()
    return [line for line in lines if '"level": "error"' in line or '"level":"error"' in line or "Traceback" in line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--redis-url", help="sessions in this Redis (keys under a fresh prefix); default: memory")
    args = parser.parse_args(argv)

    upstream = HostileUpstream(lenient=True).start()
    generator = HostileHTTP(args.seed, api_keys=API_KEYS, admin_key=ADMIN_KEY)
    try:
        with tempfile.TemporaryFile() as log, proxy(upstream.url, proxy_env(args.redis_url), log) as base:
            host, port = base.removeprefix("http://").removesuffix("/v1").split(":")
            started = time.monotonic()
            report = run(host, int(port), list(generator.requests(args.requests)), args.workers)
            elapsed = time.monotonic() - started
            time.sleep(0.5)  # background bookkeeping logs after the answers
            log.seek(0)
            errors = error_lines(log.read())
    finally:
        upstream.stop()
    print(f"seed {args.seed}: {report.summary()} in {elapsed:.1f} s; {len(errors)} ERROR log lines")
    for line in report.problems[:20] + errors[:10]:
        print("  " + line[:300])
    return 1 if report.problems or errors else 0


if __name__ == "__main__":
    sys.exit(main())
