"""Direct vs through-the-proxy runs of the workload against one server, with its own counters.

One *phase* plays every session of one scenario (streaming, `bench.real_vllm.streaming`) against an
OpenAI base URL, with a ``cache_salt`` of its own, and reads the server's Prometheus counters
(``vllm:prefix_cache_queries_total`` / ``..._hits_total``, the TTFT / prefill-time / queue-time
histogram sums) before and after, so the server's own accounting can be set next to what its
responses' ``usage`` said. Scenarios run one after another (never interleaved), which makes the
counter deltas per scenario exact as long as nothing else uses the server meanwhile.

Isolation: vLLM's block hash of the FIRST block includes the request's ``cache_salt`` and every
later block hash chains on it, so two runs with different salts share no cached block (vLLM 0.32
accepts the field on /v1/chat/completions without any flag; the proxy forwards it unchanged; the
fake backend implements it the same way). vLLM's ``POST /reset_prefix_cache`` also works, but only
with ``VLLM_SERVER_DEV_MODE=1`` (without it the route does not exist), it fails while requests run,
and it would empty the cache of a server that other tests share.
"""

from __future__ import annotations

import asyncio
import math
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import httpx

from bench.real_vllm.streaming import TimedStat, make_sessions, run_sessions_streaming, timed
from testbed.workload.runner import ScenarioResult, overall

OVERALL = "overall"
_METRIC_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")
_COUNTER_NAMES = {
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "ttft_sum_s": "vllm:time_to_first_token_seconds_sum",
    "ttft_count": "vllm:time_to_first_token_seconds_count",
    "prefill_sum_s": "vllm:request_prefill_time_seconds_sum",
    "prefill_count": "vllm:request_prefill_time_seconds_count",
    "queue_sum_s": "vllm:request_queue_time_seconds_sum",
}


@dataclass(frozen=True)
class EngineCounters:
    """The server's cumulative counters (summed over label sets); subtract two for a delta."""

    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0
    prefill_sum_s: float = 0.0
    prefill_count: float = 0.0
    queue_sum_s: float = 0.0

    def __sub__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def __add__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def parse_counters(metrics_text: str) -> EngineCounters:
    by_metric = {metric: 0.0 for metric in _COUNTER_NAMES.values()}
    for line in metrics_text.splitlines():
        match = _METRIC_LINE.match(line)
        if match and match["name"] in by_metric:
            by_metric[match["name"]] += float(match["value"])
    return EngineCounters(**{attr: by_metric[metric] for attr, metric in _COUNTER_NAMES.items()})


async def read_counters(client: httpx.AsyncClient, metrics_url: str) -> EngineCounters:
    response = await client.get(metrics_url)
    response.raise_for_status()
    return parse_counters(response.text)


@dataclass
class ScenarioRun:
    """One scenario played once against one server."""

    result: ScenarioResult
    #: the server's counter delta over the run (None when no metrics URL was given)
    engine: EngineCounters | None = None
    wall_s: float = 0.0

    @property
    def stats(self) -> list[TimedStat]:
        return timed(self.result)


@dataclass
class PhaseSpec:
    label: str  # "direct", "proxied", "fake direct", ...
    base_url: str  # OpenAI base URL (…/v1)
    metrics_url: str | None  # the SERVER's /metrics (vLLM's, also when the phase goes through the proxy)
    cache_salt: str | None


@dataclass
class Workload:
    scenarios: list[str]
    sessions: int = 3
    seed: int = 0
    max_tokens: int = 32
    concurrency: int = 1
    max_user_turns: int | None = None
    model: str = "tiny-llama"


async def run_scenario(
    spec: PhaseSpec,
    scenario: str,
    workload: Workload,
    *,
    settle_timeout_s: float = 10.0,
    progress: Callable[[int], None] | None = None,
) -> ScenarioRun:
    """Play one scenario's sessions through ``spec``; counter deltas when ``spec.metrics_url``."""
    sessions = make_sessions([scenario], workload.sessions, workload.seed, workload.max_user_turns)
    extra = {"cache_salt": spec.cache_salt} if spec.cache_salt else None
    async with httpx.AsyncClient(timeout=30) as client:
        before = await read_counters(client, spec.metrics_url) if spec.metrics_url else None
        started = time.monotonic()
        results = await run_sessions_streaming(
            spec.base_url,
            sessions,
            model=workload.model,
            max_tokens=workload.max_tokens,
            concurrency=workload.concurrency,
            extra_body=extra,
            progress=progress,
        )
        wall = time.monotonic() - started
        result = results.get(scenario, ScenarioResult(scenario))
        delta = None
        if before is not None and spec.metrics_url:
            # The engine updates its counters from its output loop, possibly just after the response.
            ok = [s for s in result.per_request if s.error is None]
            deadline = time.monotonic() + settle_timeout_s
            while True:
                delta = await read_counters(client, spec.metrics_url) - before
                settled = delta.prefix_queries >= sum(s.prompt_tokens for s in ok) and delta.ttft_count >= len(ok)
                if settled or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
    return ScenarioRun(result, delta, wall)


async def play(
    specs: Sequence[PhaseSpec], workload: Workload, *, log: Callable[[str], None] | None = None
) -> dict[str, dict[str, ScenarioRun]]:
    """Every scenario through every spec: scenario by scenario, each spec in turn (direct then proxied
    per scenario, so a drift in machine load affects both sides alike). Results by spec label."""
    runs: dict[str, dict[str, ScenarioRun]] = {spec.label: {} for spec in specs}
    for scenario in workload.scenarios:
        for spec in specs:
            run = await run_scenario(spec, scenario, workload)
            runs[spec.label][scenario] = run
            if log is not None:
                log(describe_run(spec.label, scenario, run))
    return runs


def describe_run(label: str, scenario: str, run: ScenarioRun) -> str:
    r = run.result
    ttfts = [s.ttft_s for s in run.stats if s.ttft_s is not None]
    line = (
        f"{label:>13} {scenario:<15} {r.requests:3d} req {r.errors} err {run.wall_s:6.1f}s  "
        f"prompt {r.prompt_tokens:6d} cached {r.cached_tokens:6d} hit {100 * r.hit_rate:5.1f}%"
    )
    if run.engine is not None:
        line += f" (metrics {100 * run.engine.hit_rate:5.1f}%)"
    if ttfts:
        line += f"  TTFT p50 {statistics.median(ttfts):.3f}s"
    if r.error_samples:
        line += f"  first error: {r.error_samples[0]}"
    return line


# -- statistics --------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def linear_fit(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``y = a + b x``; None with fewer than two distinct x."""
    pts = list(points)
    if len({x for x, _ in pts}) < 2:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    b = sxy / sxx
    return my - b * mx, b


def merged(runs: Mapping[str, ScenarioRun]) -> ScenarioRun:
    """All scenarios of a phase as one run (requests, counters and wall time summed)."""
    result = overall([r.result for r in runs.values()], OVERALL)
    result.per_request = [s for r in runs.values() for s in r.result.per_request]
    engines = [r.engine for r in runs.values() if r.engine is not None]
    engine = sum(engines, EngineCounters()) if engines else None
    return ScenarioRun(result, engine, sum(r.wall_s for r in runs.values()))


@dataclass
class Side:
    """The numbers of one scenario on one side (direct or proxied) of the comparison."""

    run: ScenarioRun
    values: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, run: ScenarioRun) -> Side:
        r = run.result
        stats = run.stats
        ttfts = [s.ttft_s for s in stats if s.ttft_s is not None]
        values: dict[str, Any] = {
            "requests": r.requests,
            "errors": r.errors,
            "error_samples": list(r.error_samples),
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "completion_tokens": r.completion_tokens,
            "hit_rate": r.hit_rate,
            "prefill_tokens": r.prefill_tokens,
            "ttft_median_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p95_s": percentile(ttfts, 95),
            "ttft_sum_s": sum(ttfts),
            "wall_s": run.wall_s,
        }
        if r.actions:
            values["proxy_actions"] = dict(sorted(r.actions.items()))
        if r.mean_overhead_ms is not None:
            values["proxy_overhead_ms_mean"] = r.mean_overhead_ms
        if run.engine is not None:
            e = run.engine
            values.update(
                {
                    "metrics_queries": e.prefix_queries,
                    "metrics_hits": e.prefix_hits,
                    "metrics_hit_rate": e.hit_rate,
                    "usage_minus_metrics_queries": r.prompt_tokens - e.prefix_queries,
                    "usage_minus_metrics_hits": r.cached_tokens - e.prefix_hits,
                    "engine_requests": e.ttft_count,
                    "engine_ttft_sum_s": e.ttft_sum_s,
                    "engine_prefill_time_s": e.prefill_sum_s,
                    "engine_queue_time_s": e.queue_sum_s,
                }
            )
        return cls(run, values)

    def __getitem__(self, key: str) -> Any:
        return self.values.get(key)


def compare(
    direct: Mapping[str, ScenarioRun],
    proxied: Mapping[str, ScenarioRun],
    fake_direct: Mapping[str, ScenarioRun] | None = None,
    fake_proxied: Mapping[str, ScenarioRun] | None = None,
    *,
    miss_threshold: float = 0.5,
    hit_rate_tolerance_pp: float = 5.0,
    ttft_ratio_target: float = 0.5,
) -> dict[str, Any]:
    """Per scenario (and overall): both sides, the fake backend's prediction, TTFT ratio, prefill saved;
    then the issue's targets, checked."""
    names = list(direct)
    rows: dict[str, dict[str, Any]] = {}
    all_stats: list[TimedStat] = []
    for name in [*names, OVERALL]:
        if name == OVERALL:
            d_run, p_run = merged(direct), merged(proxied)
            fd = merged(fake_direct) if fake_direct else None
            fp = merged(fake_proxied) if fake_proxied else None
        else:
            d_run, p_run = direct[name], proxied[name]
            fd = fake_direct.get(name) if fake_direct else None
            fp = fake_proxied.get(name) if fake_proxied else None
            all_stats.extend(d_run.stats + p_run.stats)
        d, p = Side.of(d_run), Side.of(p_run)
        row: dict[str, Any] = {"direct": d.values, "proxied": p.values}
        if fd is not None and fp is not None:
            row["fake_direct"] = _fake_side(fd)
            row["fake_proxied"] = _fake_side(fp)
            row["proxied_minus_fake_pp"] = 100 * (p["hit_rate"] - fp.result.hit_rate)
            row["direct_minus_fake_pp"] = 100 * (d["hit_rate"] - fd.result.hit_rate)
        if d["ttft_median_s"] and p["ttft_median_s"] is not None:
            row["ttft_median_ratio"] = p["ttft_median_s"] / d["ttft_median_s"]
        row["prefill_tokens_saved"] = d["prefill_tokens"] - p["prefill_tokens"]
        row["client_ttft_sum_saved_s"] = d["ttft_sum_s"] - p["ttft_sum_s"]
        if d["engine_prefill_time_s"] is not None and p["engine_prefill_time_s"] is not None:
            row["engine_prefill_time_saved_s"] = d["engine_prefill_time_s"] - p["engine_prefill_time_s"]
        rows[name] = row

    # Seconds per computed prompt token: TTFT against (prompt - cached) over every request measured.
    fit = linear_fit((s.prompt_tokens - s.cached_tokens, s.ttft_s) for s in all_stats if s.ttft_s is not None)
    if fit is not None:
        for row in rows.values():
            row["fit_prefill_time_saved_s"] = fit[1] * row["prefill_tokens_saved"]

    targets = _targets(rows, names, miss_threshold, hit_rate_tolerance_pp, ttft_ratio_target)
    out: dict[str, Any] = {
        "scenarios": rows,
        "ttft_fit": None if fit is None else {"intercept_s": fit[0], "seconds_per_prefill_token": fit[1]},
        "targets": targets,
    }
    if fake_direct is not None and fake_proxied is not None:
        out["per_request_vs_fake"] = {
            "direct": request_agreement(direct, fake_direct),
            "proxied": request_agreement(proxied, fake_proxied),
        }
    return out


def request_agreement(real: Mapping[str, ScenarioRun], fake: Mapping[str, ScenarioRun]) -> dict[str, Any]:
    """How many requests (matched by scenario, session and step) got the same prompt and cached tokens."""

    def index(runs: Mapping[str, ScenarioRun]) -> dict[tuple[str, str, int], tuple[int, int]]:
        return {
            (name, s.session_id, s.step): (s.prompt_tokens, s.cached_tokens)
            for name, run in runs.items()
            for s in run.result.per_request
            if s.error is None
        }

    a, b = index(real), index(fake)
    differing = sorted(key for key in a if a[key] != b.get(key))
    return {
        "requests": len(a),
        "identical": len(a) - len(differing),
        "differing": [
            {"request": "/".join(map(str, key)), "vllm": a[key], "fake": b.get(key)} for key in differing[:20]
        ],
    }


def _fake_side(run: ScenarioRun) -> dict[str, Any]:
    r = run.result
    out: dict[str, Any] = {
        "requests": r.requests,
        "errors": r.errors,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "hit_rate": r.hit_rate,
        "prefill_tokens": r.prefill_tokens,
    }
    if r.actions:
        out["proxy_actions"] = dict(sorted(r.actions.items()))
    return out


def _targets(
    rows: dict[str, dict[str, Any]], names: list[str], miss_threshold: float, tolerance_pp: float, ratio: float
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    total = rows[OVERALL]
    if "fake_proxied" in total:
        diff = total["proxied_minus_fake_pp"]
        out["hit_rate_vs_fake"] = {
            "vllm_proxied_hit_rate": total["proxied"]["hit_rate"],
            "fake_proxied_hit_rate": total["fake_proxied"]["hit_rate"],
            "difference_pp": diff,
            "tolerance_pp": tolerance_pp,
            "met": abs(diff) <= tolerance_pp,
        }
    missed = [n for n in names if rows[n]["direct"]["hit_rate"] < miss_threshold]
    per = {}
    for name in missed:
        value = rows[name].get("ttft_median_ratio")
        per[name] = {"ratio": value, "met": value is not None and value <= ratio}
    out["ttft_median_halved"] = {
        "scenarios_direct_misses": missed,
        "direct_hit_rate_below": miss_threshold,
        "target_ratio": ratio,
        "per_scenario": per,
        "met": bool(per) and all(v["met"] for v in per.values()),
    }
    diffs = [
        (rows[n][side].get("usage_minus_metrics_hits"), rows[n][side].get("usage_minus_metrics_queries"))
        for n in names
        for side in ("direct", "proxied")
    ]
    if all(h is not None for h, _ in diffs):
        out["usage_agrees_with_metrics"] = {"met": all(h == 0 and q == 0 for h, q in diffs)}
    errors = sum(rows[OVERALL][side]["errors"] for side in ("direct", "proxied"))
    out["no_errors"] = {"errors": errors, "met": errors == 0}
    return out
