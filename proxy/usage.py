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
            prompt_tokens=_as_int(usage.get("prompt_tokens")),
            completion_tokens=_as_int(usage.get("completion_tokens")),
            cached_tokens=_as_int(cached),
        )


def _as_int(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0
