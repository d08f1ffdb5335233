"""``prefix-proxy ramp``: input length (and concurrency) ramped against a backend, vLLM's metrics read.

Each step sends ``concurrency`` streaming requests at once, each a prompt of about
``input_tokens`` tokens that starts with its own random words (so nothing hits the prefix cache:
the step measures prefill, not reuse), and records time to first token and throughput from the
client side, and from vLLM's ``/metrics`` (polled during the step, diffed around it): KV-cache
usage, preemptions, queue length and per-request queue / prefill / decode time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from proxy.capacity.knee import Step
from proxy.capacity.vllm_metrics import EngineSnapshot, snapshot

METRICS_POLL_S = 0.2
WORDS = [
    "river",
    "stone",
    "maple",
    "cloud",
    "lantern",
    "harbor",
    "copper",
    "meadow",
    "violet",
    "thunder",
    "orchard",
    "canyon",
    "ember",
    "glacier",
    "falcon",
    "prairie",
    "summit",
    "willow",
    "cobalt",
    "tundra",
    "quartz",
    "juniper",
    "mosaic",
    "nebula",
    "saffron",
    "timber",
    "velvet",
]

Progress = Callable[[int, int], None]


@dataclass
class RampConfig:
    upstream: str  # OpenAI base URL, e.g. http://127.0.0.1:8000/v1
    model: str
    concurrencies: list[int]
    input_lengths: list[int]
    output_tokens: int = 64
    api_key: str | None = None
    timeout_s: float = 600.0
    ignore_eos: bool = False
    seed: int = 0

    @property
    def server_root(self) -> str:
        return self.upstream.rstrip("/").removesuffix("/v1")


@dataclass
class Measured:
    ttft: float | None = None
    e2e: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class RampRun:
    steps: list[Step] = field(default_factory=list)
    metrics_text: str = ""  # the backend's /metrics before the ramp (pool size, engine info)
    tokens_per_word: float = 1.0
    # Tokens every request carries besides the words (chat template, role markers).
    overhead_tokens: float = 0.0


def prompt_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, count)))


async def run_ramp(config: RampConfig, progress: Progress | None = None) -> RampRun:
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=max(config.concurrencies) + 4)
    async with httpx.AsyncClient(timeout=config.timeout_s, headers=headers, limits=limits) as client:
        run = RampRun(metrics_text=await _metrics(client, config))
        run.tokens_per_word, run.overhead_tokens = await _calibrate(client, config)
        total = len(config.concurrencies) * len(config.input_lengths)
        done = 0
        rng = random.Random(config.seed)
        for concurrency in config.concurrencies:
            for length in sorted(config.input_lengths):
                words = max(1, round((length - run.overhead_tokens) / run.tokens_per_word))
                run.steps.append(await _step(client, config, concurrency, length, words, rng))
                done += 1
                if progress is not None:
                    progress(done, total)
    return run


async def _calibrate(client: httpx.AsyncClient, config: RampConfig) -> tuple[float, float]:
    """Tokens per filler word and fixed tokens per request, from the backend's own count of two probes."""
    counts = []
    for words in (50, 250):
        measured = await _request(client, config, prompt_words(random.Random(-words), words), 1)
        if measured.error or not measured.prompt_tokens:
            raise RuntimeError(f"probe request failed: {measured.error or 'no usage reported'}")
        counts.append(measured.prompt_tokens)
    per_word = max((counts[1] - counts[0]) / 200, 0.1)
    return per_word, max(0.0, counts[0] - 50 * per_word)


async def _step(
    client: httpx.AsyncClient, config: RampConfig, concurrency: int, length: int, words: int, rng: random.Random
) -> Step:
    before = snapshot(await _metrics(client, config))
    peak = {"kv": 0.0, "waiting": 0.0}
    stop = asyncio.Event()

    async def poll() -> None:
        while not stop.is_set():
            now = snapshot(await _metrics(client, config))
            peak["kv"] = max(peak["kv"], now.kv_usage)
            peak["waiting"] = max(peak["waiting"], now.waiting)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), METRICS_POLL_S)

    poller = asyncio.create_task(poll())
    prompts = [prompt_words(rng, words) for _ in range(concurrency)]
    started = time.perf_counter()
    results = await asyncio.gather(*(_request(client, config, p, config.output_tokens) for p in prompts))
    wall = time.perf_counter() - started
    stop.set()
    await poller
    after = snapshot(await _metrics(client, config))
    return summarize(concurrency, length, results, wall, before, after, peak["kv"], peak["waiting"])


def summarize(
    concurrency: int,
    length: int,
    results: Sequence[Measured],
    wall: float,
    before: EngineSnapshot,
    after: EngineSnapshot,
    kv_peak: float,
    waiting_peak: float,
) -> Step:
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]

    def mean_of(seconds: float, count: float) -> float:
        return seconds / count if count > 0 else 0.0

    return Step(
        concurrency=concurrency,
        input_tokens=length,
        prompt_tokens=statistics.fmean(r.prompt_tokens for r in ok) if ok else 0.0,
        ttft_p50=statistics.median(ttfts) if ttfts else 0.0,
        ttft_max=max(ttfts) if ttfts else 0.0,
        e2e_p50=statistics.median(r.e2e for r in ok) if ok else 0.0,
        output_tokens_per_s=sum(r.completion_tokens for r in ok) / wall if wall > 0 else 0.0,
        prompt_tokens_per_s=sum(r.prompt_tokens for r in ok) / wall if wall > 0 else 0.0,
        kv_usage_max=max(kv_peak, after.kv_usage),
        waiting_max=waiting_peak,
        preemptions=after.preemptions - before.preemptions,
        queue_s_mean=mean_of(after.queue_seconds - before.queue_seconds, after.queue_count - before.queue_count),
        prefill_s_mean=mean_of(
            after.prefill_seconds - before.prefill_seconds, after.prefill_count - before.prefill_count
        ),
        decode_s_mean=mean_of(after.decode_seconds - before.decode_seconds, after.decode_count - before.decode_count),
        errors=len(results) - len(ok),
    )


async def _metrics(client: httpx.AsyncClient, config: RampConfig) -> str:
    try:
        response = await client.get(config.server_root + "/metrics", timeout=10)
    except httpx.HTTPError:
        return ""
    return response.text if response.is_success else ""


async def _request(client: httpx.AsyncClient, config: RampConfig, prompt: str, max_tokens: int) -> Measured:
    body: dict[str, object] = {
        "model": config.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    measured = Measured()
    started = time.perf_counter()
    try:
        async with client.stream("POST", config.upstream.rstrip("/") + "/chat/completions", json=body) as response:
            if response.status_code >= 400:
                text = (await response.aread()).decode(errors="replace")[:200]
                return Measured(error=f"HTTP {response.status_code}: {text}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if measured.ttft is None and chunk.get("choices"):
                    measured.ttft = time.perf_counter() - started
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    measured.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    measured.completion_tokens = int(usage.get("completion_tokens") or 0)
    except (httpx.HTTPError, ValueError) as error:
        return Measured(error=f"{type(error).__name__}: {error}")
    measured.e2e = time.perf_counter() - started
    return measured
