"""The vLLM metrics a ramp reads, from the Prometheus text of its ``/metrics``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.capacity.pool import KVPool

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        out.append((name, dict(_LABEL.findall(labels or "")), number))
    return out


@dataclass(frozen=True)
class EngineSnapshot:
    """Counters summed over labels (engines, models), gauges at their maximum."""

    kv_usage: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    preemptions: float = 0.0
    prefill_seconds: float = 0.0
    prefill_count: float = 0.0
    decode_seconds: float = 0.0
    decode_count: float = 0.0
    queue_seconds: float = 0.0
    queue_count: float = 0.0


def snapshot(text: str) -> EngineSnapshot:
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    for name, _, value in samples(text):
        sums[name] = sums.get(name, 0.0) + value
        maxima[name] = max(maxima.get(name, value), value)
    return EngineSnapshot(
        kv_usage=maxima.get("vllm:kv_cache_usage_perc", maxima.get("vllm:gpu_cache_usage_perc", 0.0)),
        running=maxima.get("vllm:num_requests_running", 0.0),
        waiting=maxima.get("vllm:num_requests_waiting", 0.0),
        preemptions=sums.get("vllm:num_preemptions_total", 0.0),
        prefill_seconds=sums.get("vllm:request_prefill_time_seconds_sum", 0.0),
        prefill_count=sums.get("vllm:request_prefill_time_seconds_count", 0.0),
        decode_seconds=sums.get("vllm:request_decode_time_seconds_sum", 0.0),
        decode_count=sums.get("vllm:request_decode_time_seconds_count", 0.0),
        queue_seconds=sums.get("vllm:request_queue_time_seconds_sum", 0.0),
        queue_count=sums.get("vllm:request_queue_time_seconds_count", 0.0),
    )


def pool_from_metrics(text: str) -> KVPool | None:
    """vLLM's ``cache_config_info`` names its block count and size (labels of a constant gauge); one
    block is vLLM's null block, never handed to a request."""
    for name, labels, _ in samples(text):
        if name == "vllm:cache_config_info":
            try:
                return KVPool(int(labels["num_gpu_blocks"]) - 1, int(labels.get("block_size", "16")))
            except (KeyError, ValueError):
                return None
    return None


def has_engine_signals(text: str) -> bool:
    """Whether the backend exports preemptions and queue time (vLLM does; the fake backend has no queue time)."""
    names = {name for name, _, _ in samples(text)}
    return "vllm:num_preemptions_total" in names and "vllm:request_queue_time_seconds_count" in names
