"""The fake engine: tokenizer, prefix cache, metrics and bookkeeping behind the HTTP layer.

Cache mutations are short synchronous calls made under one lock and never span an
``await``, so concurrent requests see a consistent cache, as requests inside one vLLM
scheduler step do. A request whose prompt does not fit in the free blocks waits (vLLM's
WAITING queue) until running requests release theirs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from proxy.enginemodel import ChatTokenizer, PrefixCache, RequestBlocks, load_tokenizer
from testbed.fakevllm.config import FakeBackendConfig
from testbed.fakevllm.detokenizer import token_text_deltas
from testbed.fakevllm.metrics import BackendMetrics
from testbed.fakevllm.requestlog import RequestLog, StreamStats

ADMISSION_POLL_S = 0.002


@dataclass(frozen=True)
class Generation:
    """What the fake model samples for one request."""

    text: str  # decoded output, without the end token
    token_ids: list[int]  # sampled ids, ending with the end token when finish_reason is "stop"
    token_texts: list[str]  # text each id adds when streamed ("" for the end token)
    finish_reason: str  # "stop" or "length"


def generate(tokenizer: ChatTokenizer, raw_text: str, max_tokens: int) -> Generation:
    """Sample ``raw_text`` then the end token, stopping at ``max_tokens`` like vLLM."""
    ids = tokenizer.encode(raw_text)
    if len(ids) < max_tokens:
        texts = token_text_deltas(tokenizer, ids)
        return Generation("".join(texts), [*ids, tokenizer.eos_token_id], [*texts, ""], "stop")
    ids = ids[:max_tokens]
    texts = token_text_deltas(tokenizer, ids)
    return Generation("".join(texts), ids, texts, "length")


@dataclass(frozen=True)
class Admission:
    """A running request's blocks, tied to the cache that holds them (a reset swaps caches)."""

    cache: PrefixCache
    blocks: RequestBlocks

    @property
    def cached_tokens(self) -> int:
        return self.blocks.num_cached_tokens


class FakeEngine:
    def __init__(self, config: FakeBackendConfig, tokenizer: ChatTokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer_path, config.eos_token)
        self._lock = threading.Lock()
        self.num_running = 0
        self.num_waiting = 0
        self.cache = self._new_cache()
        self.metrics = self._new_metrics()
        self.log = RequestLog(config.request_log_size)
        self.streams = StreamStats()

    def check_fits(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt can never be admitted, or None."""
        needed = self.cache.blocks_needed(num_prompt_tokens)
        if needed > self.cache.capacity_blocks:
            return (
                f"The prompt needs {needed} KV cache blocks but the fake backend only has "
                f"{self.cache.capacity_blocks} (cache_capacity_blocks)."
            )
        return None

    async def admit(self, prompt_token_ids: list[int], cache_salt: str | None) -> Admission:
        """Get the request's blocks, waiting while the pool is full."""
        waiting = False
        try:
            while True:
                with self._lock:
                    cache = self.cache
                    request = cache.admit(prompt_token_ids, cache_salt)
                if request is not None:
                    break
                if not waiting:
                    waiting = True
                    self.num_waiting += 1
                await asyncio.sleep(ADMISSION_POLL_S)
        finally:
            if waiting:
                self.num_waiting -= 1
        self.num_running += 1
        if cache.enable_caching:
            self.metrics.prefix_cache_queries.inc(request.num_prompt_tokens)
            self.metrics.prefix_cache_hits.inc(request.num_cached_tokens)
        return Admission(cache, request)

    def first_token(self, num_prompt_tokens: int, ttft_s: float) -> None:
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.time_to_first_token.observe(ttft_s)

    def finish(
        self, admission: Admission, sampled_token_ids: list[int], finished_reason: str, started_at: float
    ) -> None:
        """Cache what the request computed and release its blocks (idempotent)."""
        if admission.blocks.finished:
            return
        with self._lock:
            admission.cache.finish(admission.blocks, sampled_token_ids)
        self.num_running -= 1
        self.metrics.generation_tokens.inc(len(sampled_token_ids))
        self.metrics.request_finished(finished_reason, time.monotonic() - started_at)

    def reset(self) -> None:
        """Forget everything: cache, counters, request log, stream stats."""
        with self._lock:
            self.cache = self._new_cache()
        self.metrics = self._new_metrics()
        self.log.clear()
        self.streams = StreamStats()

    def _new_cache(self) -> PrefixCache:
        return PrefixCache(
            block_size=self.config.block_size,
            capacity_blocks=self.config.cache_capacity_blocks,
            enable_caching=self.config.enable_prefix_caching,
        )

    def _new_metrics(self) -> BackendMetrics:
        return BackendMetrics(
            self.config.metrics_model_name,
            kv_cache_usage=lambda: self.cache.usage,
            num_running=lambda: self.num_running,
            num_waiting=lambda: self.num_waiting,
        )
