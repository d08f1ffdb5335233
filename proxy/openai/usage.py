"""Token usage as the upstream reports it (the ground truth for what it computed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def prefill_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @classmethod
    def from_openai(cls, usage: Any) -> Usage | None:
        """Parse an OpenAI ``usage`` object; a missing ``cached_tokens`` means 0 (vLLM omits it on a miss)."""
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(
            prompt_tokens=token_count(usage.get("prompt_tokens")),
            completion_tokens=token_count(usage.get("completion_tokens")),
            cached_tokens=token_count(cached),
        )


def token_count(value: Any) -> int:
    """A token count as a protocol's usage reports it; anything but a positive integer counts 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
