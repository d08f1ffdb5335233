"""The proxy in front of a real vLLM: vLLM itself reports more prefix-cache hits through the proxy.

A short Dify-style workload (dify_rag, fc_agent, timestamp_user; 4 sessions each, 3 user turns,
streaming, max_tokens 32) is played directly against the session's real vLLM (`real_vllm` fixture)
and through the proxy (default settings, in-process), each run with its own ``cache_salt`` so
neither reuses the other's (or an earlier test's) cache. vLLM's /metrics counters are read around
every scenario. The fake backend, configured with the engine's own tokenizer and block size, plays
the same sessions to check that it predicts what vLLM reports.

The last test needs no engine: the streaming client, the comparison and the report against the fake
backend only (it runs wherever the project's tests run).
"""

from __future__ import annotations

import asyncio
import secrets
import sys

import pytest

from bench.real_vllm.compare import EngineCounters, PhaseSpec, ScenarioRun, Workload, merged, play
from bench.real_vllm.engine import RealVLLM
from proxy.app import create_app
from proxy.config import Settings
from tests.helpers import LiveServer

SCENARIOS = ["dify_rag", "fc_agent", "timestamp_user"]

Runs = dict[str, dict[str, ScenarioRun]]


def workload(engine: RealVLLM) -> Workload:
    # Four sessions: the proxy leaves a span where the client put it until it has seen the span's
    # place vary, so each app's first request goes out as sent (timestamp_user has three apps).
    return Workload(
        scenarios=SCENARIOS, sessions=4, seed=0, max_tokens=32, concurrency=1, max_user_turns=3, model=engine.model
    )


@pytest.fixture(scope="module")
def runs(real_vllm: RealVLLM) -> Runs:
    """The workload direct and through the proxy, scenario by scenario, with vLLM's counter deltas."""
    run_id = secrets.token_hex(6)
    metrics = real_vllm.base_url + "/metrics"
    with LiveServer(create_app(Settings(upstream=real_vllm.openai_base_url))) as proxy:
        specs = [
            PhaseSpec("direct", real_vllm.openai_base_url, metrics, f"test-direct-{run_id}"),
            PhaseSpec("proxied", proxy.url + "/v1", metrics, f"test-proxied-{run_id}"),
        ]
        return asyncio.run(play(specs, workload(real_vllm), log=lambda line: print(line, file=sys.stderr)))


def engine_delta(run: ScenarioRun) -> EngineCounters:
    assert run.engine is not None
    return run.engine


@pytest.mark.real_engine
def test_no_errors_and_every_request_reached_vllm(runs: Runs) -> None:
    for side, by_scenario in runs.items():
        for scenario, run in by_scenario.items():
            result = run.result
            assert result.errors == 0, (side, scenario, result.error_samples)
            assert result.requests >= 4 * 3, (side, scenario)  # 4 sessions x 3 user turns at least
            # Exactly one engine request per client request (nothing retried, nothing added by the proxy).
            assert engine_delta(run).ttft_count == result.requests, (side, scenario)


@pytest.mark.real_engine
def test_usage_cached_tokens_agree_with_vllm_metrics(runs: Runs) -> None:
    for side, by_scenario in runs.items():
        for scenario, run in by_scenario.items():
            delta = engine_delta(run)
            assert delta.prefix_queries == run.result.prompt_tokens, (side, scenario)
            assert delta.prefix_hits == run.result.cached_tokens, (side, scenario)


@pytest.mark.real_engine
def test_vllm_reports_a_higher_hit_rate_through_the_proxy(runs: Runs) -> None:
    direct, proxied = runs["direct"], runs["proxied"]
    for scenario in SCENARIOS:
        d, p = engine_delta(direct[scenario]), engine_delta(proxied[scenario])
        # Each of these clients breaks the prefix on every request; the proxy repairs it.
        assert d.hit_rate < 0.2, (scenario, d)
        assert p.hit_rate > d.hit_rate + 0.3, (scenario, d.hit_rate, p.hit_rate)
    total_d, total_p = engine_delta(merged(direct)), engine_delta(merged(proxied))
    assert total_p.hit_rate > total_d.hit_rate + 0.4, (total_d.hit_rate, total_p.hit_rate)
    # The proxy relocates content, never drops it: vLLM saw about as many prompt tokens.
    assert abs(total_p.prefix_queries - total_d.prefix_queries) <= 0.02 * total_d.prefix_queries


@pytest.mark.real_engine
def test_fake_backend_predicts_what_vllm_reports(runs: Runs, real_vllm: RealVLLM) -> None:
    from bench.real_vllm.run import run_fake

    fake_direct, fake_proxied = run_fake(
        workload(real_vllm),
        real_vllm.model_dir,
        real_vllm.block_size,
        real_vllm.max_model_len,
        secrets.token_hex(6),
        log=None,
    )
    for label, real, fake in (("direct", runs["direct"], fake_direct), ("proxied", runs["proxied"], fake_proxied)):
        real_rate, fake_rate = merged(real).result.hit_rate, merged(fake).result.hit_rate
        assert abs(real_rate - fake_rate) <= 0.05, (label, real_rate, fake_rate)


def test_streaming_client_matches_the_workload_runner_and_reports() -> None:
    """No engine: streamed sessions see what the (non-streaming) workload runner sees, and the report renders."""
    from bench.real_vllm.compare import compare
    from bench.real_vllm.report import markdown
    from testbed.fakevllm import FakeBackendConfig
    from testbed.fakevllm import create_app as create_fake
    from testbed.workload import run_workload

    small = Workload(scenarios=["dify_rag", "fc_agent"], sessions=2, max_tokens=32, max_user_turns=2, model="m")
    config = FakeBackendConfig(model="m", block_size=32)
    with LiveServer(create_fake(config)) as fake, LiveServer(create_fake(config)) as fake2:
        with LiveServer(create_app(Settings(upstream=fake2.url + "/v1"))) as proxy:
            specs = [
                PhaseSpec("direct", fake.url + "/v1", fake.url + "/metrics", "a"),
                PhaseSpec("proxied", proxy.url + "/v1", fake2.url + "/metrics", "b"),
            ]
            runs = asyncio.run(play(specs, small))
        reference = run_workload(fake.url + "/v1", ["fc_agent"], sessions_per_scenario=2, max_tokens=32, model="m")
    streamed = runs["direct"]["fc_agent"].result
    stats = runs["direct"]["fc_agent"].stats
    # The runner plays whole sessions (3-6 turns); the streamed ones stop after 2 user turns.
    by_step = {
        (s.session_id, s.step): (s.prompt_tokens, s.completion_tokens) for s in reference["fc_agent"].per_request
    }
    assert all(by_step[(s.session_id, s.step)] == (s.prompt_tokens, s.completion_tokens) for s in streamed.per_request)
    assert len(stats) == streamed.requests
    assert all(s.ttft_s is not None and s.latency_s is not None and s.ttft_s <= s.latency_s for s in stats)

    result = compare(runs["direct"], runs["proxied"], runs["direct"], runs["proxied"])
    assert result["targets"]["no_errors"]["met"]
    assert result["targets"]["usage_agrees_with_metrics"]["met"]
    assert result["scenarios"]["overall"]["proxied"]["hit_rate"] > result["scenarios"]["overall"]["direct"]["hit_rate"]
    config_row = {"preset": "fake", "block_size": 32, "sessions": 2, "seed": 0, "max_tokens": 32, "concurrency": 1}
    text = markdown(result, config_row)
    assert "| fc_agent |" in text and "## Targets" in text
