"""Token usage as the upstream reports it (the ground truth for what it computed).

Ground truth only when it could be true: a ``usage`` block with no prompt, a negative or
fractional count, or more tokens than any context holds is the upstream's nonsense, and reads as
no usage at all (None), so that the caller falls back to its own estimate rather than charging 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# No prompt or answer is this long (ten times the longest context any model serves): a count past
# it is not usage.
MAX_TOKENS = 100_000_000


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Whether the answer said how many prompt tokens were cached (``prompt_tokens_details.cached_tokens``):
    # vLLM leaves it out on a miss, and engines that do not report reuse (TGI, Ollama, SGLang without
    # --enable-cache-report) always do: 0 then means "not said", not "none cached".
    cached_reported: bool = True

    @property
    def total_tokens(self) -> int:
        """Prompt and completion: what the request left in the engine's context, and what a budget
        is charged for it."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def prefill_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def plausible(self) -> bool:
        """Counts an upstream could have meant: a prompt of at least one token (every request has
        one), none past :data:`MAX_TOKENS`, no more cached than prompted."""
        return (
            0 < self.prompt_tokens <= MAX_TOKENS
            and 0 <= self.completion_tokens <= MAX_TOKENS
            and 0 <= self.cached_tokens <= self.prompt_tokens
        )

    @classmethod
    def from_openai(cls, usage: Any) -> Usage | None:
        """Parse an OpenAI ``usage`` object; None when it is not one or is nonsense (see the module
        doc). A missing ``cached_tokens`` means 0 (vLLM omits it on a miss); a missing
        ``completion_tokens`` only where ``total_tokens`` says there were none (embeddings)."""
        if not isinstance(usage, dict):
            return None
        prompt = strict_count(usage.get("prompt_tokens"))
        completion: Any = usage.get("completion_tokens")
        if completion is None and prompt is not None and usage.get("total_tokens") == prompt:
            completion = 0
        completion = strict_count(completion)
        details = usage.get("prompt_tokens_details")
        cached: Any = details.get("cached_tokens") if isinstance(details, dict) else None
        reported = cached is not None
        cached = 0 if cached is None else strict_count(cached)
        if prompt is None or completion is None or cached is None:
            return None
        parsed = cls(prompt, completion, cached, reported)
        return parsed if parsed.plausible else None


def strict_count(value: Any) -> int | None:
    """A token count that must be there: a non-negative integer up to :data:`MAX_TOKENS`, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS:
        return value
    return None


def token_count(value: Any) -> int:
    """A token count as a protocol's usage reports it; anything but a positive integer counts 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
