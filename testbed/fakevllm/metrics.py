"""vLLM's Prometheus metrics, under vLLM's exact names and labels, on a private registry.

prometheus-client appends ``_total`` to counter names, so counters are declared without it
(``vllm:prefix_cache_queries`` is exposed as ``vllm:prefix_cache_queries_total``, like vLLM's
own). Labels are vLLM v1's ``model_name`` and ``engine`` (always ``"0"`` here).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# vLLM v1's buckets for these histograms.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LABELS = ("model_name", "engine")


class BackendMetrics:
    """One engine's metrics; gauges are read from callables at scrape time."""

    def __init__(
        self,
        model_name: str,
        *,
        kv_cache_usage: Callable[[], float],
        num_running: Callable[[], int],
        num_waiting: Callable[[], int],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name, "engine": "0"}
        self._labels = labels

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labelnames=_LABELS, registry=self.registry)

        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ).labels(**labels)
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(**labels)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(**labels)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(
            **labels
        )
        # The fake never preempts (a request that does not fit waits); exported at 0 like vLLM's own.
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.").labels(
            **labels
        )
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labelnames=(*_LABELS, "finished_reason"),
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labelnames=_LABELS,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labelnames=_LABELS,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(name, doc, labelnames=_LABELS, registry=self.registry).labels(**labels).set_function(read)

        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage)
        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", num_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", num_waiting)

    def request_finished(self, finished_reason: str, e2e_latency_s: float) -> None:
        self._request_success.labels(**self._labels, finished_reason=finished_reason).inc()
        self.e2e_request_latency.observe(e2e_latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
