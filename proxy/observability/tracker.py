"""The proxy's side of miss explanation: one :class:`PendingBreak` per chat request.

``CacheBreakTracker.observe`` runs once the forwarded prompt is final (canonicalized, summary
applied) and before it is sent: it explains the request against what was forwarded before and
remembers it. The answer then settles it (usage: calibrated tokens, ``cache_evicted``) and
records the generated reply, which vLLM caches too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cachetools import LRUCache

from proxy.config import CacheBreakSettings
from proxy.http import PendingCacheBreak
from proxy.observability.breaks import CAUSES, NONE, BreakMemory, CacheBreak, Comparison
from proxy.observability.digests import digest_prompt, message_hash
from proxy.observability.metrics import Metrics
from proxy.openai import Continuations, Usage
from proxy.recent import peek

HEADER = "x-prefix-proxy-cache-break"
# Model names remembered as reporting cached tokens.
REPORTING_MODELS = 1024


@dataclass
class PendingBreak:
    """One request's explanation until its answer settles it."""

    explanation: CacheBreak
    prompt_id: int
    memory: BreakMemory
    model: str = ""
    # The models whose answers said how many prompt tokens were cached (shared by the tracker).
    reporting: LRUCache[str, bool] | None = None

    def header(self) -> str:
        return self.explanation.header()

    def settle(self, usage: Usage | None) -> bool:
        """Apply the reported usage; True the first time (then count it). An eviction is judged only
        for a model whose answers have said what was cached: an engine that never reports reuse
        (TGI, Ollama) would otherwise show every continuing turn as evicted."""
        if usage is None or self.explanation.settled:
            return False
        reporting = self.reporting
        if reporting is not None and usage.cached_reported and usage.cached_tokens:
            reporting[self.model] = True
        cached = usage.cached_tokens if reporting is None or self.model in reporting else None
        self.explanation.settle(usage.prompt_tokens, cached)
        self.memory.calibrate(self.prompt_id, usage.prompt_tokens)
        return self.explanation.settled

    def record_reply(self, message: dict[str, Any] | None) -> None:
        if message:
            digest, size = message_hash(message)
            self.memory.record_reply(self.prompt_id, digest, size)


class CacheBreakTracker:
    def __init__(
        self, settings: CacheBreakSettings, metrics: Metrics, *, forwarded: Continuations[Any] | None = None
    ) -> None:
        self.enabled = settings.enabled
        self.memory = BreakMemory(settings.memory_prompts, settings.block_size)
        # (tenant, the backend's answer id) -> the prompt it answered: what a client's cache
        # diagnostics name (Anthropic's previous_message_id, Responses' comparison_response_id).
        # Per tenant: another tenant's id is not found.
        self._answers: LRUCache[tuple[str, str], int] = LRUCache(max(1, settings.memory_prompts))
        self._metrics = metrics
        # Models whose answers have said how many prompt tokens were cached, by the name requests
        # give (a backend answered for it; bounded: an engine that resolves names loosely answers
        # for any number of spellings).
        self._reporting: LRUCache[str, bool] = LRUCache(REPORTING_MODELS)
        # Per tenant and conversation, the last prompt digested: the next one hashes only what it adds
        # (``forwarded``: the memory shared with the other parts that read these messages).
        self._forwarded: Continuations[Any] = forwarded if forwarded is not None else Continuations()
        for cause in CAUSES:
            metrics.cache_break_tokens.labels(cause)
            metrics.cache_breaks.labels(cause)

    def observe(
        self,
        tenant: str,
        conversation: str | None,
        forwarded: dict[str, Any],
        actions: Iterable[str],
        *,
        summary_at: int = -1,
        system_count: int | None = None,
        tokens_per_byte: float | None = None,
    ) -> PendingBreak | None:
        """``system_count``: the stable leading system messages (a block of moved volatile lines
        inserted right after them is history, not system prompt)."""
        if not self.enabled:
            return None
        messages = forwarded.get("messages") or []
        resumed = self._forwarded.resume(tenant, messages, "digests")
        prompt = digest_prompt(
            forwarded, tenant, summary_at, system_count, previous=resumed.state, shared=resumed.shared
        )
        resumed.keep(messages, prompt)
        moved = any(action.startswith("volatile_moved") for action in actions)
        key = f"{tenant}\x1f{conversation}" if conversation else None
        explanation, prompt_id = self.memory.observe(prompt, key, moved_volatile=moved, tokens_per_byte=tokens_per_byte)
        model = forwarded.get("model")
        return PendingBreak(explanation, prompt_id, self.memory, str(model), self._reporting)

    def remember_answer(self, tenant: str, answer_id: str, pending: PendingBreak) -> None:
        if answer_id and len(answer_id) <= 256:
            self._answers[(tenant, answer_id)] = pending.prompt_id

    def compare(self, tenant: str, answer_id: str | None, pending: PendingBreak) -> Comparison | None:
        """This request's prompt against the one the tenant's answer ``answer_id`` answered; None
        when that answer is unknown (another tenant's, forgotten, or never relayed)."""
        if not answer_id:
            return None
        previous = peek(self._answers, (tenant, answer_id))
        if previous is None:
            return None
        return self.memory.compare(pending.prompt_id, previous)

    def count(self, pending: PendingCacheBreak) -> None:
        """Counters for a settled request (label values: :data:`CAUSES` only, never text)."""
        explanation = pending.explanation
        if explanation.cause == NONE:
            return
        self._metrics.cache_breaks.labels(explanation.cause).inc()
        if explanation.tokens_lost > 0:
            self._metrics.cache_break_tokens.labels(explanation.cause).inc(explanation.tokens_lost)


def summary_index(anchored: Any) -> int:
    """Where the proxy's summary message sits in the forwarded messages (-1: none)."""
    if anchored is None or not getattr(anchored, "removed", 0):
        return -1
    start = int(getattr(anchored, "history_start", 0))
    return start - 1 if start > 0 else -1
