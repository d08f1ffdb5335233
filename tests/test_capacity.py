"""KV capacity (prefix-proxy kv), knee detection and prefix-proxy ramp against the fake backend."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from proxy.capacity.knee import Knee, Step, find_knee
from proxy.capacity.plot import render_svg
from proxy.capacity.pool import GIB, KVPool, pool_from_memory
from proxy.capacity.vllm_metrics import has_engine_signals, pool_from_metrics, snapshot
from proxy.cli import main
from testbed.fakevllm import FakeBackendConfig, create_app
from tests.helpers import LiveServer

VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="64"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.5
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 3.0
"""


def test_pool_from_gpu_memory_and_what_fits() -> None:
    # Llama-3.1-8B fp16 (128 KiB a token) on 80 GiB at 0.9, 15 GiB of weights, 2 of activations:
    # 55 GiB of 2 MiB blocks, less vLLM's null block.
    pool = pool_from_memory(80 * GIB, 128 * 1024, utilization=0.9, weights_bytes=15 * GIB, activation_bytes=2 * GIB)
    assert pool == KVPool(28_159, 16)
    assert pool.tokens == 450_544
    assert pool.max_context(8, output_tokens=512) == 28_159 // 8 * 16 - 512
    assert pool.max_concurrency(8192) == 28_159 // 512
    with pytest.raises(ValueError):
        pool_from_memory(80 * GIB, 128 * 1024, utilization=1.5)


def test_vllm_metrics_are_read() -> None:
    assert pool_from_metrics(VLLM_METRICS) == KVPool(63, 32)
    assert pool_from_metrics("vllm:kv_cache_usage_perc 0.1\n") is None
    engine = snapshot(VLLM_METRICS)
    assert (engine.kv_usage, engine.waiting, engine.preemptions, engine.queue_seconds) == (0.5, 2.0, 3.0, 1.5)
    assert has_engine_signals(VLLM_METRICS) and not has_engine_signals("vllm:num_preemptions_total 0\n")


def step(input_tokens: int, ttft: float, **kwargs: float) -> Step:
    return Step(4, input_tokens, prompt_tokens=input_tokens, ttft_p50=ttft, ttft_max=ttft, **kwargs)  # type: ignore[arg-type]


def test_knee_from_engine_signals_first_and_ttft_only_without_them() -> None:
    steps = [step(256, 0.10), step(512, 0.19), step(768, 0.60), step(1024, 0.9, preemptions=2)]
    # vLLM's counters decide: a slow step without preemptions or queueing is noise.
    assert find_knee(steps) == Knee(4, 768, 1024, "preemptions")
    # Without them (the fake backend), the TTFT per token doubling is the knee.
    assert find_knee(steps, engine_signals=False) == Knee(4, 512, 768, "ttft")
    queued = [step(256, 0.1), step(512, 0.4, queue_s_mean=0.2, waiting_max=2)]
    assert find_knee(queued) == Knee(4, 256, 512, "queueing")
    assert find_knee([step(256, 0.1), step(512, 0.2)]) == Knee(4, 512, None, None)


def test_plot_is_an_svg_with_a_line_per_concurrency() -> None:
    steps = [step(256, 0.1), step(512, 0.3)] + [Step(1, n, n, 0.05 * n / 256, 0.05 * n / 256) for n in (256, 512)]
    svg = render_svg(steps, [find_knee(steps[:2])], {4: 448, 1: 1984}, title="m <ramp>")
    root = ET.fromstring(svg)
    polylines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(polylines) == 4  # TTFT and KV usage, for each concurrency
    assert "m &lt;ramp&gt;" in svg and "stroke-dasharray" in svg


def test_kv_command_prints_the_pool(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["kv", "--model", "llama-3.1-8b", "--gpu-memory-gib", "80", "--weights-gib", "15"]
    assert main([*args, "--activation-gib", "2", "--concurrency", "1,8", "--output-length", "512"]) == 0
    out = capsys.readouterr().out
    assert "28,159 blocks of 16 tokens = 450,544 tokens" in out
    assert f"{28_159 // 8 * 16 - 512:,}" in out


def test_ramp_against_the_fake_backend_finds_the_pool_knee(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """64 blocks of 16 tokens: 4 requests of 384 tokens and more no longer fit at once, so some wait.

    Prefill is slow enough (1.5 ms a token) that a scheduling hiccup of a loaded CI machine (tens of
    milliseconds on the 64-token step) cannot pass for the knee."""
    config = FakeBackendConfig(
        cache_capacity_blocks=64, prefill_seconds_per_token=0.0015, seconds_per_output_token=0.004, max_model_len=1024
    )
    server = LiveServer(create_app(config)).start()
    try:
        plot = tmp_path / "ramp.svg"
        argv = ["ramp", "--upstream", server.url + "/v1", "--model", "fake-model", "--concurrency", "4"]
        argv += ["--input-lengths", "64,128,512,768", "--output-length", "16", "--kv-blocks", "63"]
        assert main([*argv, "--block-size", "16", "--plot", str(plot), "--json", "--no-progress"]) == 0
    finally:
        server.stop()
    report = json.loads(capsys.readouterr().out)
    assert [s["input_tokens"] for s in report["steps"]] == [64, 128, 512, 768]
    assert all(s["errors"] == 0 and s["prompt_tokens"] > 0 for s in report["steps"])
    assert report["steps"][-1]["prompt_tokens"] == pytest.approx(768, rel=0.1)
    (critical,) = report["critical_context"]
    assert critical["predicted"] == 63 // 4 * 16 - 16
    assert critical["reason"] == "ttft" and critical["measured"] in (128, 512)
    assert plot.read_text().startswith("<svg")
