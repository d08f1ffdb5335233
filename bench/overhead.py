"""Latency and CPU the proxy adds, measured against a direct connection in one interleaved run.

    python -m bench.overhead [--work | --instant] [--requests N] [--before CHECKOUT]
                             [--tokens 8000] [--litellm PATH] [--vllm-router PATH] [--no-peers]
                             [--sessions N] [--profile DIR [--profile-native]] [--py-spy PATH]

Two backends, both modes by default:

- ``--work``: the fake vLLM backend, which does work per request (tokenizes, computes prefill on
  a prefix cache): concurrency 1 and 16, non-stream (full response) and stream (time to first
  chunk), 1k- and 8k-token prompts, distinct per request so every path does the same backend work.
  Per case, the proxy's CPU time per proxied request too. The backend's own time hides part of
  the hop's cost in the throughput ratio.
- ``--instant``: a backend that answers at once (``bench.instant_backend``), so what is measured
  is the hop itself: prefix-proxy on its default settings and, side by side, the same server and
  upstream client with none of its logic (``bench.bare_hop``: what the logic costs is the
  difference), that stack with the body parsed and written again (``bench.bare_hop --json``: the
  floor of any proxy that rewrites the body in Python), LiteLLM's proxy and vLLM Router (round
  robin over one worker: the floor of a proxy hop) when their executables are found
  (``--litellm``, ``--vllm-router``, on ``PATH`` or next to this Python; ``--no-peers``:
  prefix-proxy only). Per proxy: the median added at concurrency 1, the median and p99 added and
  the throughput against direct at concurrency 16, the CPU time the proxy process (and its
  children) spent per request over ``--requests`` sequential requests, and its resident memory
  before and after. ``--sessions N`` then sends N distinct conversations to each prefix-proxy
  (in-memory session store) and gives its RSS; ``--saved-requests N`` (40) sends N requests of each
  real shape to a fake vLLM backend (it tokenizes and keeps vLLM's prefix cache) directly and,
  through a fresh prefix-proxy, to another, and sets the proxy's CPU per request beside the prefill
  it saves per request and the GPU time that takes on a stated reference (``PREFILL_TOKENS_PER_S``:
  an H100-class GPU running Llama-3.1-8B, ``--prefill-rate`` another); ``--profile DIR`` then records each prefix-proxy
  with py-spy over ``--requests`` more sequential requests (after the CPU figure, which sampling
  would disturb): ``DIR/<name>.txt`` (collapsed stacks), ``DIR/<name>.svg`` (flame graph) and the
  top entries (``bench.stacks``).

``--before CHECKOUT`` adds another checkout of prefix-proxy (a before/after comparison), run with
the checkout's own ``.venv`` where it has one. Every
proxy of a mode runs at once, and the direct path and the proxies take turns, request by request
or batch by batch, in an order that rotates: a machine that slows down mid-run weighs on all of
them alike (measured one after the other, the same build differed by 25% in CPU per request).
``python -m bench.hop`` is ``--instant``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson

from bench import shapes, stacks
from bench.servers import fake_backend, free_port, spawn
from bench.shapes import Shape
from proxy.tokenization import load_encoding
from testbed.reference import PREFILL_TOKENS_PER_S, REFERENCE_GPU, gpu_ms

MODEL = "fake-model"
FILLER = (
    "The quarterly report covers revenue, margins, inventory turnover and regional performance. "
    "Each section lists the figures, the change against last quarter and the reasons given by managers. "
)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CPU_ROUNDS = 4
LITELLM_KEY = "sk-bench-hop-0000000000000000"  # a local benchmark process, not a credential
BARE_HOP = "bare stack (no logic)"
JSON_HOP = "bare stack + JSON"
T = TypeVar("T")


def prompt_of(tokens: int, salt: int) -> str:
    encoding = load_encoding()
    unit = len(encoding.encode_ordinary(FILLER))
    return f"Request {salt}. " + FILLER * max(1, tokens // unit)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# The proxy process: CPU time and resident memory from /proc.


def tree_pids(pid: int) -> list[int]:
    """The process and its descendants (LiteLLM runs workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


@dataclass(frozen=True)
class CpuReading:
    """CPU time of a process and its descendants at one moment; two readings subtract to the
    seconds between them. Counted by the kernel in nanoseconds per thread
    (``/proc/<pid>/task/<tid>/schedstat``) where it keeps the count and every thread of the first
    reading is in the second with a count no lower (an ended thread's count goes with it; a new
    thread may take an old id); otherwise in user and
    system clock ticks (1/100 s: over 300 requests, half of vLLM Router's CPU per request on the
    real-prompt rows). Read between measurements, when the servers are idle (a running thread's
    count is brought up to date at its next switch)."""

    threads: dict[tuple[int, int], int]
    ticks: int

    def __sub__(self, before: CpuReading) -> float:
        now = self.threads
        # Every thread still there, its count not gone back (not a new thread under an old id).
        if now and all(now.get(thread, -1) >= count for thread, count in before.threads.items()):
            return (sum(now.values()) - sum(before.threads.values())) / 1e9
        return (self.ticks - before.ticks) / CLOCK_TICKS


def cpu_reading(pid: int) -> CpuReading:
    pids = tree_pids(pid)
    threads: dict[tuple[int, int], int] = {}
    if PRECISE_CPU:
        for each in pids:
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{each}/task").iterdir():
                    with contextlib.suppress(OSError, IndexError, ValueError):
                        threads[(each, int(task.name))] = int((task / "schedstat").read_text().split()[0])
    return CpuReading(threads, _ticks(pids))


def _ticks(pids: list[int]) -> int:
    total = 0
    for each in pids:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


PRECISE_CPU = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").exists()


def rss_mib(pid: int) -> float:
    total = 0
    for each in tree_pids(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


# The proxies under test.


@dataclass
class Hop:
    name: str
    base_url: str
    pid: int
    headers: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def prefix_proxy(
    upstream: str, source: str | None = None, name: str = "prefix-proxy", settings: dict[str, str] | None = None
) -> Iterator[Hop]:
    """prefix-proxy on its default settings (access log on, to /dev/null), from this tree or ``source``;
    ``settings``: environment variables that change some (``PREFIX_PROXY_...``)."""
    port = free_port()
    # A checkout's own virtual environment where it has one: dependencies change between commits.
    own_python = Path(source, ".venv", "bin", "python") if source else None
    python = str(own_python) if own_python and own_python.exists() else sys.executable
    args = [python, "-m", "proxy", "serve", "--upstream", upstream, "--port", str(port)]
    env = {**({"PYTHONPATH": source} if source else {}), **(settings or {})}
    with spawn(args, f"http://127.0.0.1:{port}/healthz", env=env, cwd=source) as proc:
        yield Hop(name, f"http://127.0.0.1:{port}/v1", proc.pid)


@contextlib.contextmanager
def bare_hop(upstream: str, *, json: bool = False) -> Iterator[Hop]:
    """The proxy's server and upstream client without its logic (``bench.bare_hop``); ``json``: the
    body parsed and written again."""
    port = free_port()
    args = [sys.executable, "-m", "bench.bare_hop", "--upstream", upstream, "--port", str(port)]
    with spawn([*args, "--json"] if json else args, f"http://127.0.0.1:{port}/healthz") as proc:
        yield Hop(JSON_HOP if json else BARE_HOP, f"http://127.0.0.1:{port}/v1", proc.pid)


@contextlib.contextmanager
def litellm(executable: str, upstream: str) -> Iterator[Hop]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "litellm.yaml"
        config.write_text(
            "model_list:\n"
            f"  - model_name: {MODEL}\n"
            "    litellm_params:\n"
            f"      model: openai/{MODEL}\n"
            f"      api_base: {upstream}\n"
            "      api_key: unused\n"
            "general_settings:\n"
            f"  master_key: {LITELLM_KEY}\n"
        )
        args = [executable, "--config", str(config), "--port", str(port), "--num_workers", "1"]
        with spawn(args, f"http://127.0.0.1:{port}/health/liveliness", timeout=180) as proc:
            yield Hop("LiteLLM", f"http://127.0.0.1:{port}/v1", proc.pid, {"authorization": f"Bearer {LITELLM_KEY}"})


@contextlib.contextmanager
def vllm_router(executable: str, upstream_root: str) -> Iterator[Hop]:
    port = free_port()
    args = [executable, "--worker-urls", upstream_root, "--policy", "round_robin", "--port", str(port)]
    with spawn(args, f"http://127.0.0.1:{port}/health") as proc:
        yield Hop("vLLM Router", f"http://127.0.0.1:{port}/v1", proc.pid)


def find(explicit: str | None, name: str) -> str | None:
    """``explicit``, else on PATH, else next to this Python (a virtual environment not activated)."""
    beside = Path(sys.executable).parent / name
    return explicit or shutil.which(name) or (str(beside) if beside.is_file() else None)


def checkouts(before: str | None) -> list[tuple[str, str | None]]:
    """The prefix-proxy builds to measure: name and source tree (None: this one)."""
    return [*([("prefix-proxy before", before)] if before else []), ("prefix-proxy", None)]


# Every proxy under test runs at once and the paths (direct, then each proxy) take turns, the order
# rotating from one round to the next: a machine that slows down or speeds up mid-run (other
# processes, a noisy neighbour) weighs on every path alike, so before/after compares like with like.


def rotated(items: list[T], shift: int) -> list[T]:
    shift %= len(items)
    return items[shift:] + items[:shift]


# --work: a backend that does work per request.


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    overhead_header_ms: list[float] = field(default_factory=list)
    cpu_ms_per_request: float = 0.0


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


async def run_case(
    direct: str, hops: list[Hop], tokens: int, concurrency: int, stream: bool, n: int
) -> tuple[Samples, list[Samples]]:
    """The direct path's samples and each hop's."""
    paths: list[tuple[str, Hop | None]] = [(direct, None), *((hop.base_url, hop) for hop in hops)]
    samples = [Samples() for _ in paths]
    prompts = [prompt_of(tokens, i) for i in range(n)]
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        # Warm every path (connections, code paths) before measuring.
        for base, _ in paths:
            await one(client, base, {"model": MODEL, "messages": [{"role": "user", "content": "warm"}]}, stream, None)
        cpu_before = [cpu_reading(hop.pid) for hop in hops]
        for round_index, round_start in enumerate(range(0, n, concurrency)):
            batch = prompts[round_start : round_start + concurrency]
            for (base, hop), sink in rotated(list(zip(paths, samples, strict=True)), round_index):
                bodies = [
                    {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": p + base[-8:]}]}
                    for p in batch
                ]
                header_ms = sink.overhead_header_ms if hop else None
                started = time.perf_counter()
                sink.latencies.extend(await asyncio.gather(*(one(client, base, b, stream, header_ms) for b in bodies)))
                sink.wall += time.perf_counter() - started
        for hop, sink, before in zip(hops, samples[1:], cpu_before, strict=True):
            sink.cpu_ms_per_request = (cpu_reading(hop.pid) - before) / len(sink.latencies) * 1e3
    return samples[0], samples[1:]


def work_report(rows: list[tuple[str, Samples, Samples]]) -> str:
    header = (
        f"{'case':<28}{'direct p50':>11}{'proxy p50':>11}{'added p50':>11}{'added p99':>11}"
        f"{'thru ratio':>11}{'hdr p50':>9}{'cpu/req':>10}"
    )
    lines = [header, "-" * len(header)]
    for name, direct, proxied in rows:
        d50, p50 = statistics.median(direct.latencies), statistics.median(proxied.latencies)
        d99, p99 = percentile(direct.latencies, 0.99), percentile(proxied.latencies, 0.99)
        ratio = (len(proxied.latencies) / proxied.wall) / (len(direct.latencies) / direct.wall)
        hdr = f"{statistics.median(proxied.overhead_header_ms):.2f}" if proxied.overhead_header_ms else "-"
        lines.append(
            f"{name:<28}{d50 * 1e3:>9.2f}ms{p50 * 1e3:>9.2f}ms{(p50 - d50) * 1e3:>9.2f}ms"
            f"{(p99 - d99) * 1e3:>9.2f}ms{ratio:>11.3f}{hdr:>9}{proxied.cpu_ms_per_request:>8.2f}ms"
        )
    lines.append("added = proxied - direct (same percentile); thru ratio = proxied req/s / direct req/s;")
    lines.append("hdr = the proxy's own x-prefix-proxy-overhead-ms (non-stream only);")
    lines.append("cpu/req = the proxy process's CPU time per proxied request. Stream rows time the first chunk.")
    return "\n".join(lines)


async def work_mode(requests: int, before: str | None) -> str:
    with fake_backend() as direct, contextlib.ExitStack() as stack:
        hops = [stack.enter_context(prefix_proxy(direct, source, name)) for name, source in checkouts(before)]
        rows: list[list[tuple[str, Samples, Samples]]] = [[] for _ in hops]
        for tokens in (1000, 8000):
            for concurrency in (1, 16):
                for stream in (False, True):
                    n = max(concurrency * 4, requests if concurrency == 1 else requests * 2)
                    case = f"{tokens // 1000}k c={concurrency} {'stream/ttfc' if stream else 'non-stream'}"
                    direct_samples, proxied = await run_case(direct, hops, tokens, concurrency, stream, n)
                    for hop_rows, samples in zip(rows, proxied, strict=True):
                        hop_rows.append((case, direct_samples, samples))
                    print(f"  done {case}", file=sys.stderr, flush=True)
    return "\n\n".join(
        f"{hop.name}, fake vLLM backend (work per request), {requests} requests at c=1\n{work_report(hop_rows)}"
        for hop, hop_rows in zip(hops, rows, strict=True)
    )


# --instant: the hop itself, behind a backend that answers at once.


@dataclass(frozen=True)
class Saved:
    """Prefill tokens per request, direct and through prefix-proxy (each in front of its own fake
    vLLM backend), over ``requests`` requests of a shape."""

    direct: float
    proxied: float
    requests: int

    @property
    def tokens(self) -> float:
        return self.direct - self.proxied


def _prefill(path: str, answer: dict[str, Any]) -> int:
    """Prompt tokens the backend computed for one answer (not served from its prefix cache)."""
    from proxy.protocols import CHAT_COMPLETIONS, MESSAGES

    protocol = MESSAGES if path == "/messages" else CHAT_COMPLETIONS
    usage = protocol.read_usage(answer.get("usage"))
    return usage.prefill_tokens if usage is not None else 0


async def prefill_saved(shape: Shape, requests: int) -> Saved:
    """What prefix-proxy saves the backend on ``shape``: the same ``requests`` requests (whole
    conversations, as the CPU figure sends them; not streamed) sent one after the other to a fake
    vLLM backend (it tokenizes and keeps vLLM's prefix cache: blocks of 16 tokens) directly, and
    through a fresh prefix-proxy on its defaults to another; prefill = prompt - cached tokens, as
    each backend reports them."""
    with fake_backend() as direct, fake_backend() as behind, prefix_proxy(behind) as hop:
        totals = [0, 0]
        async with httpx.AsyncClient(timeout=300) as client:
            start = shape.phase_start(6)
            for i in range(start, start + requests):
                body = {key: value for key, value in shape.body(i).items() if key != "stream_options"}
                body["stream"] = False
                headers = {"content-type": "application/json", **(shape.headers(i) or {})}
                for k, base in enumerate((direct, hop.base_url)):
                    response = await client.post(base + shape.path, content=orjson.dumps(body), headers=headers)
                    response.raise_for_status()
                    totals[k] += _prefill(shape.path, response.json())
    return Saved(totals[0] / requests, totals[1] / requests, requests)


def saved_table(rows: list[tuple[Shape, shapes.Size, list[HopResult]]], saved: dict[str, Saved], rate: float) -> str:
    """Per shape: prefix-proxy's CPU per request beside the prefill it saves per request and the
    GPU time that prefill takes on the reference (``rate`` prompt tokens a second); vLLM Router's
    CPU (the floor of a hop) where it ran."""
    names = [r.name for r in rows[0][2]]
    router = names.index("vLLM Router") if "vLLM Router" in names else None
    header = ["shape", "prefix-proxy CPU/req (ms)", "prefill/req direct -> via prefix-proxy (tokens)"]
    header += ["saved/req (tokens)", "GPU time saved/req (ms)", "saved / CPU"]
    header += ["vLLM Router CPU/req (ms)"] if router is not None else []
    lines = [f"| {' | '.join(header)} |", "|---" * len(header) + "|"]
    for shape, _, results in rows:
        found = saved.get(shape.name)
        proxy = next((r for r in results if r.name == "prefix-proxy"), None)
        if found is None or proxy is None:
            continue
        gpu_time = gpu_ms(found.tokens, rate)
        cells = [
            shape.name,
            f"{proxy.cpu_ms_per_request:.2f}",
            f"{found.direct:,.0f} -> {found.proxied:,.0f}",
            f"{found.tokens:,.0f}",
            f"{gpu_time:.1f}",
            f"{gpu_time / proxy.cpu_ms_per_request:.0f}x" if proxy.cpu_ms_per_request > 0 and gpu_time > 0 else "-",
        ]
        if router is not None:
            cells.append(f"{results[router].cpu_ms_per_request:.2f}")
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


@dataclass
class HopResult:
    name: str
    added_p50_c1: float = 0.0
    added_p50_c16: float = 0.0
    added_p99_c16: float = 0.0
    throughput_c16: float = 0.0
    cpu_ms_per_request: float = 0.0
    rss_mib: tuple[float, float] = (0.0, 0.0)
    notes: list[str] = field(default_factory=list)


class Sender:
    """Request ``i`` of a shape, as bytes made before the clock starts, to one path (every path gets
    the same sequence)."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self._made: dict[int, tuple[bytes, dict[str, str]]] = {}

    def prepare(self, indices: range) -> None:
        for i in indices:
            if i not in self._made:
                headers = {"content-type": "application/json", **(self.shape.headers(i) or {})}
                self._made[i] = (orjson.dumps(self.shape.body(i)), headers)

    def forget(self) -> None:
        self._made.clear()

    async def send(self, client: httpx.AsyncClient, base: str, i: int, headers: dict[str, str] | None) -> float:
        if i not in self._made:
            self.prepare(range(i, i + 1))
        content, own = self._made[i]
        started = time.perf_counter()
        response = await client.post(base + self.shape.path, content=content, headers={**own, **(headers or {})})
        response.raise_for_status()
        return time.perf_counter() - started


@contextlib.contextmanager
def profiled(pid: int, out: Path, py_spy: str, native: bool = False) -> Iterator[None]:
    """py-spy records ``pid`` meanwhile into ``out`` (collapsed stacks, one line per distinct stack).

    Frames are aggregated by function; py-spy pauses the process for each sample (whole stacks, no
    torn ones). ``native`` adds C frames (uvloop, the GC, system calls).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    args = [py_spy, "record", "--pid", str(pid), "--rate", "500", "--function", "--format", "raw", "--output", str(out)]
    args += ["--native"] if native else []
    recorder = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # attach before the measured requests
    try:
        yield
    finally:
        recorder.send_signal(2)  # SIGINT: py-spy writes the file and exits
        _, error = recorder.communicate(timeout=60)
        if recorder.returncode != 0 or not out.is_file():
            raise RuntimeError(f"py-spy failed ({recorder.returncode}): {error.decode(errors='replace')[-500:]}")


async def measure(direct: str, hops: list[Hop], shape: Shape, requests: int) -> list[HopResult]:
    """Every hop against the direct path, the paths taking turns (see ``rotated``); each path is
    sent the same requests of ``shape`` (made before they are timed)."""
    results = [HopResult(hop.name) for hop in hops]
    paths: list[tuple[str, dict[str, str] | None]] = [(direct, None), *((hop.base_url, hop.headers) for hop in hops)]
    sender = Sender(shape)
    # Idle connections expire well before the servers' keep-alive (uvicorn's 5 s, httpx's default
    # too): a path idles while the others take their turns, slow shapes for seconds.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        warm = shape.phase_start(1)
        sender.prepare(range(warm, warm + 20))
        for base, headers in paths:
            for i in range(warm, warm + 20):  # warm connections and code paths
                await sender.send(client, base, i, headers)
        rss_before = [rss_mib(hop.pid) for hop in hops]
        # Concurrency 1: one request on each path in turn.
        start = shape.phase_start(2)
        sender.prepare(range(start, start + requests))
        latencies: list[list[float]] = [[] for _ in paths]
        for i in range(start, start + requests):
            for k in rotated(list(range(len(paths))), i):
                base, headers = paths[k]
                latencies[k].append(await sender.send(client, base, i, headers))
        for result, samples in zip(results, latencies[1:], strict=True):
            result.added_p50_c1 = statistics.median(samples) - statistics.median(latencies[0])
        # Concurrency 16: a batch of 16 on each path in turn.
        sender.forget()
        start = shape.phase_start(3)
        batches = max(4, requests // 16)
        sender.prepare(range(start, start + batches * 16))
        latencies = [[] for _ in paths]
        walls = [0.0 for _ in paths]
        for batch in range(batches):
            for k in rotated(list(range(len(paths))), batch):
                base, headers = paths[k]
                first = start + batch * 16
                started = time.perf_counter()
                concurrent = (sender.send(client, base, first + j, headers) for j in range(16))
                latencies[k].extend(await asyncio.gather(*concurrent))
                walls[k] += time.perf_counter() - started
        for result, samples, wall in zip(results, latencies[1:], walls[1:], strict=True):
            result.added_p50_c16 = statistics.median(samples) - statistics.median(latencies[0])
            result.added_p99_c16 = percentile(samples, 0.99) - percentile(latencies[0], 0.99)
            result.throughput_c16 = (len(samples) / wall) / (len(latencies[0]) / walls[0])
        # CPU per request: sequential requests through each hop, in four rounds of turns.
        sender.forget()
        start = shape.phase_start(4)
        sender.prepare(range(start, start + requests))
        cpu = [0.0 for _ in hops]
        rounds = CPU_ROUNDS
        for r in range(rounds):
            for k in rotated(list(range(len(hops))), r):
                hop = hops[k]
                before = cpu_reading(hop.pid)
                for i in range(start + r * requests // rounds, start + (r + 1) * requests // rounds):
                    await sender.send(client, hop.base_url, i, hop.headers)
                cpu[k] += cpu_reading(hop.pid) - before
        for result, hop, seconds, rss in zip(results, hops, cpu, rss_before, strict=True):
            result.cpu_ms_per_request = seconds / requests * 1e3
            result.rss_mib = (rss, rss_mib(hop.pid))
    return results


async def profile(hop: Hop, shape: Shape, requests: int, out: Path, py_spy: str, native: bool) -> None:
    """The same sequential load as the CPU figure, recorded by py-spy."""
    sender = Sender(shape)
    start = shape.phase_start(5)
    sender.prepare(range(start, start + requests))
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(keepalive_expiry=2.0)) as client:
        with profiled(hop.pid, out, py_spy, native):
            for i in range(start, start + requests):
                await sender.send(client, hop.base_url, i, hop.headers)


async def rss_after_sessions(hop: Hop, sessions: int, concurrency: int = 16) -> float:
    """Resident memory after ``sessions`` distinct two-turn conversations (each recorded as a session)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        queue = iter(range(sessions))

        async def worker() -> None:
            for n in queue:
                messages = [
                    {"role": "user", "content": f"Conversation {n}: where is my order?"},
                    {"role": "assistant", "content": "OK, done."},
                    {"role": "user", "content": "And the invoice?"},
                ]
                response = await client.post(
                    hop.base_url + "/chat/completions",
                    json={"model": MODEL, "max_tokens": 16, "messages": messages},
                    headers=hop.headers,
                )
                response.raise_for_status()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return rss_mib(hop.pid)


def cpu_resolution_note(requests: int) -> str:
    """How CPU time was read: in nanoseconds per thread where the kernel counts them; otherwise in
    clock ticks, where a cheap hop over few requests can read as 0."""
    if PRECISE_CPU:
        return "CPU is read from /proc in nanoseconds (each thread's schedstat)."
    bound = CPU_ROUNDS / CLOCK_TICKS / requests * 1e3
    return f"CPU is read from /proc in 1/{CLOCK_TICKS} s ticks over {CPU_ROUNDS} rounds: +-{bound:.2f} ms per request."


def hop_table(results: list[HopResult]) -> str:
    rows = [
        ("p50 added, c=1 (ms)", lambda r: f"{r.added_p50_c1 * 1e3:+.2f}"),
        ("p50 / p99 added, c=16 (ms)", lambda r: f"{r.added_p50_c16 * 1e3:+.1f} / {r.added_p99_c16 * 1e3:+.1f}"),
        ("throughput vs direct, c=16", lambda r: f"{r.throughput_c16:.2f}x"),
        ("CPU per request in the proxy (ms)", lambda r: f"{r.cpu_ms_per_request:.2f}"),
        ("RSS before -> after (MiB)", lambda r: f"{r.rss_mib[0]:.0f} -> {r.rss_mib[1]:.0f}"),
    ]
    lines = [f"| added to direct | {' | '.join(r.name for r in results)} |", "|---" * (len(results) + 1) + "|"]
    lines += [f"| {label} | {' | '.join(cell(r) for r in results)} |" for label, cell in rows]
    return "\n".join(lines)


def summary_table(rows: list[tuple[Shape, shapes.Size, list[HopResult]]]) -> str:
    """One line per shape: each hop's CPU per request (and its ratio to vLLM Router's, when it ran),
    the p50 added at c=1 and the throughput against direct at c=16."""
    names = [r.name for r in rows[0][2]]
    floor = names.index("vLLM Router") if "vLLM Router" in names else None
    header = ["shape", "prompt / new tokens"]
    header += [f"CPU/req {n} (ms{', x router' if floor is not None and n != 'vLLM Router' else ''})" for n in names]
    header += [f"p50 added c=1 {n} (ms)" for n in names] + [f"thru c=16 {n}" for n in names]
    lines = [f"| {' | '.join(header)} |", "|---" * len(header) + "|"]
    for shape, size, results in rows:
        cells = [shape.name, f"{size.prompt_tokens:,} / {size.new_tokens:,}"]
        for result in results:
            cell = f"{result.cpu_ms_per_request:.2f}"
            if floor is not None and result.name != "vLLM Router" and results[floor].cpu_ms_per_request > 0:
                cell += f" ({result.cpu_ms_per_request / results[floor].cpu_ms_per_request:.1f}x)"
            cells.append(cell)
        cells += [f"{r.added_p50_c1 * 1e3:+.2f}" for r in results] + [f"{r.throughput_c16:.2f}x" for r in results]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


async def instant_mode(args: argparse.Namespace) -> str:
    backend_port = free_port()
    root = f"http://127.0.0.1:{backend_port}"
    requests = args.requests or 400
    py_spy = find(args.py_spy, "py-spy") if args.profile else None
    names = shapes.parse(args.shapes)
    print(f"building shapes {', '.join(names)} ...", file=sys.stderr, flush=True)
    built = [shapes.build(name, args.tokens) for name in names]
    notes = []
    if any(name != "oneline" for name in names):
        notes.append(f"prompts: {shapes.corpus().source}")
    backend = [sys.executable, "-m", "bench.instant_backend", "--port", str(backend_port)]
    rows: list[tuple[Shape, shapes.Size, list[HopResult]]] = []
    sections: list[str] = []
    with spawn(backend, root + "/health"), contextlib.ExitStack() as stack:
        contexts: list[tuple[str, contextlib.AbstractContextManager[Hop]]] = [
            (name, prefix_proxy(root + "/v1", source, name)) for name, source in checkouts(args.before)
        ]
        if args.peers:
            contexts.append((BARE_HOP, bare_hop(root + "/v1")))
            contexts.append((JSON_HOP, bare_hop(root + "/v1", json=True)))
        if args.peers and (path := find(args.litellm, "litellm")):
            contexts.append(("LiteLLM", litellm(path, root + "/v1")))
        if args.peers and (path := find(args.vllm_router, "vllm-router")):
            contexts.append(("vLLM Router", vllm_router(path, root)))
        hops = []
        for name, context in contexts:
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            hops.append(stack.enter_context(context))
        for shape in built:
            print(f"measuring {shape.name}: {', '.join(hop.name for hop in hops)} ...", file=sys.stderr, flush=True)
            results = await measure(root + "/v1", hops, shape, requests)
            size = shapes.size(shape)
            rows.append((shape, size, results))
            title = (
                f"{args.tokens}-token chat, instant backend, {requests} requests per measurement"
                if shape.name == "oneline"
                else f"{shape.name}: {shape.description}; POST /v1{shape.path}, about {size.prompt_tokens:,} "
                f"tokens a request, {size.new_tokens:,} of them new; instant backend, {requests} requests "
                "per measurement"
            )
            sections.append("\n".join([title, hop_table(results)]))
            if py_spy is None:
                continue
            for hop in hops:
                if not hop.name.startswith("prefix-proxy"):
                    continue
                stem = hop.name.replace(" ", "-") + ("" if shape.name == "oneline" else f"-{shape.name}")
                out = Path(args.profile) / f"{stem}.txt"
                print(f"profiling {hop.name} on {shape.name} ...", file=sys.stderr, flush=True)
                await profile(hop, shape, requests, out, py_spy, args.profile_native)
                profiled_stacks = stacks.read(out)
                out.with_suffix(".svg").write_text(stacks.svg(profiled_stacks, f"{hop.name}, {shape.name}: {out.name}"))
                top = stacks.markdown(profiled_stacks)
                notes.append(f"{hop.name}, {shape.name}, py-spy over {requests} requests ({out}):\n{top}")
        if args.sessions:
            for hop, result in zip(hops, rows[-1][2], strict=True):
                if hop.name.startswith("prefix-proxy"):
                    print(f"  {hop.name}: {args.sessions:,} sessions ...", file=sys.stderr, flush=True)
                    after = await rss_after_sessions(hop, args.sessions)
                    result.notes.append(f"RSS after {args.sessions:,} more sessions: {after:.0f} MiB")
    saved: dict[str, Saved] = {}
    if args.saved_requests:
        for shape in built:
            if shape.name != "oneline":
                print(f"prefill saved on {shape.name} ...", file=sys.stderr, flush=True)
                saved[shape.name] = await prefill_saved(shape, args.saved_requests)
    lines = ["\n\n".join(sections)]
    if len(rows) > 1:
        title = "Every shape (CPU per request in the proxy process; added = proxied - direct):"
        lines += ["", title, summary_table(rows)]
    if saved:
        title = (
            f"What the proxy costs against what it saves, per request (prefill: {args.saved_requests} requests of "
            f"each shape to a fake vLLM backend, directly and through prefix-proxy; GPU time on {REFERENCE_GPU} "
            f"at {args.prefill_rate:,.0f} prompt tokens/s):"
        )
        lines += ["", title, saved_table(rows, saved, args.prefill_rate)]
    lines.append(cpu_resolution_note(requests))
    lines += [f"{result.name}: {note}" for result in rows[-1][2] for note in result.notes]
    return "\n".join([*lines, *notes])


async def main_async(args: argparse.Namespace) -> None:
    if args.profile and not args.work and find(args.py_spy, "py-spy") is None:
        raise SystemExit("--profile: py-spy not found (pip install py-spy, or --py-spy PATH)")
    if not args.instant:
        print(await work_mode(args.requests or 100, args.before), flush=True)
        if not args.work:
            print(flush=True)
    if not args.work:
        print(await instant_mode(args), flush=True)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--work", action="store_true", help="only the backend that does work per request")
    mode.add_argument("--instant", action="store_true", help="only the instant backend (the hop itself)")
    parser.add_argument(
        "--requests", type=int, help="requests per path per measurement (default: 100 --work, 400 --instant)"
    )
    parser.add_argument("--before", help="another checkout of prefix-proxy, measured first (before/after)")
    parser.add_argument("--tokens", type=int, default=8000, help="--instant: prompt size (oneline, dify, new-system)")
    parser.add_argument(
        "--shapes",
        default="all",
        help="--instant: request shapes (bench.shapes), comma-separated, or all, or real (all but oneline): "
        + ", ".join(shapes.SHAPE_NAMES),
    )
    parser.add_argument("--litellm", help="--instant: the litellm executable (default: found as said above)")
    parser.add_argument("--vllm-router", help="--instant: the vllm-router executable (default: found)")
    parser.add_argument(
        "--peers", action=argparse.BooleanOptionalAction, default=True, help="--instant: LiteLLM and vLLM Router too"
    )
    parser.add_argument("--sessions", type=int, default=0, help="--instant: then this many sessions: RSS")
    parser.add_argument("--profile", help="--instant: a folder for py-spy profiles of prefix-proxy")
    parser.add_argument("--profile-native", action="store_true", help="--profile with C frames (py-spy --native)")
    parser.add_argument("--py-spy", help="the py-spy executable (default: found)")
    parser.add_argument(
        "--saved-requests",
        type=int,
        default=40,
        help="--instant: requests of each real shape sent to a fake vLLM backend, directly and through prefix-proxy, "
        "for the prefill it saves (0: not measured)",
    )
    parser.add_argument(
        "--prefill-rate",
        type=float,
        default=PREFILL_TOKENS_PER_S,
        help=f"prompt tokens/s of the reference GPU the saved prefill is timed on (default: {REFERENCE_GPU})",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    asyncio.run(main_async(parser().parse_args(argv)))


if __name__ == "__main__":
    main()
