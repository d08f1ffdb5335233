"""Latency the proxy adds, measured against a direct connection in one alternating run.

    python -m bench.overhead [--requests 200]

Direct and proxied requests alternate (same prompts, same backend process), at
concurrency 1 and 16, non-stream (full response) and stream (time to first
chunk), with 1k- and 8k-token prompts. Prompts are distinct per request so both
paths do the same backend work.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field

import httpx

from bench.servers import fake_backend, proxy
from proxy.tokenization import load_encoding

MODEL = "fake-model"
FILLER = (
    "The quarterly report covers revenue, margins, inventory turnover and regional performance. "
    "Each section lists the figures, the change against last quarter and the reasons given by managers. "
)


def prompt_of(tokens: int, salt: int) -> str:
    encoding = load_encoding()
    unit = len(encoding.encode_ordinary(FILLER))
    return f"Request {salt}. " + FILLER * max(1, tokens // unit)


@dataclass
class Samples:
    direct: list[float] = field(default_factory=list)
    proxied: list[float] = field(default_factory=list)
    direct_wall: float = 0.0
    proxied_wall: float = 0.0
    overhead_header_ms: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one(client: httpx.AsyncClient, base: str, body: dict, stream: bool, sink: list[float] | None) -> float:
    started = time.perf_counter()
    if not stream:
        response = await client.post(base + "/chat/completions", json=body)
        response.raise_for_status()
        if sink is not None and "x-prefix-proxy-overhead-ms" in response.headers:
            sink.append(float(response.headers["x-prefix-proxy-overhead-ms"]))
        return time.perf_counter() - started
    async with client.stream("POST", base + "/chat/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - started
        return first if first is not None else time.perf_counter() - started


async def run_case(direct: str, proxied: str, tokens: int, concurrency: int, stream: bool, n: int) -> Samples:
    samples = Samples()
    prompts = [prompt_of(tokens, i) for i in range(n)]
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        # Warm both paths (connections, code paths) before measuring.
        for base in (direct, proxied):
            await one(client, base, {"model": MODEL, "messages": [{"role": "user", "content": "warm"}]}, stream, None)
        for round_start in range(0, n, concurrency):
            batch = prompts[round_start : round_start + concurrency]
            order = (direct, proxied) if (round_start // concurrency) % 2 == 0 else (proxied, direct)
            for base in order:
                bodies = [
                    {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": p + base[-8:]}]}
                    for p in batch
                ]
                sink = samples.overhead_header_ms if base == proxied else None
                started = time.perf_counter()
                results = await asyncio.gather(*(one(client, base, b, stream, sink) for b in bodies))
                wall = time.perf_counter() - started
                if base == direct:
                    samples.direct.extend(results)
                    samples.direct_wall += wall
                else:
                    samples.proxied.extend(results)
                    samples.proxied_wall += wall
    return samples


def report(rows: list[tuple[str, Samples]]) -> str:
    header = (
        f"{'case':<28}{'direct p50':>11}{'proxy p50':>11}{'added p50':>11}{'added p99':>11}"
        f"{'thru ratio':>11}{'hdr p50':>9}"
    )
    lines = [header, "-" * len(header)]
    for name, s in rows:
        d50, p50 = statistics.median(s.direct), statistics.median(s.proxied)
        d99, p99 = percentile(s.direct, 0.99), percentile(s.proxied, 0.99)
        ratio = (len(s.proxied) / s.proxied_wall) / (len(s.direct) / s.direct_wall)
        hdr = f"{statistics.median(s.overhead_header_ms):.2f}" if s.overhead_header_ms else "-"
        lines.append(
            f"{name:<28}{d50 * 1e3:>9.2f}ms{p50 * 1e3:>9.2f}ms{(p50 - d50) * 1e3:>9.2f}ms"
            f"{(p99 - d99) * 1e3:>9.2f}ms{ratio:>11.3f}{hdr:>9}"
        )
    lines.append("added = proxied - direct (same percentile); thru ratio = proxied req/s / direct req/s;")
    lines.append("hdr = the proxy's own x-prefix-proxy-overhead-ms (non-stream only).")
    lines.append("Stream rows time the first chunk.")
    return "\n".join(lines)


async def main_async(requests: int) -> None:
    with fake_backend() as direct, proxy(direct) as proxied:
        rows = []
        for tokens in (1000, 8000):
            for concurrency in (1, 16):
                for stream in (False, True):
                    n = max(concurrency * 4, requests if concurrency == 1 else requests * 2)
                    name = f"{tokens // 1000}k c={concurrency} {'stream/ttfc' if stream else 'non-stream'}"
                    samples = await run_case(direct, proxied, tokens, concurrency, stream, n)
                    rows.append((name, samples))
                    print(f"  done {name}", flush=True)
        print(report(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100, help="requests per path per case at concurrency 1")
    args = parser.parse_args()
    asyncio.run(main_async(args.requests))


if __name__ == "__main__":
    main()
