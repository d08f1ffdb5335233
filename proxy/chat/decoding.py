"""How fast the engine decodes, measured from its answers, and the summary deadline it sets.

A summary is generation: up to ``max_summary_tokens`` decoded by the conversation's own model.
A fixed deadline fails every summary of an engine slower than it assumed (llama-server on a
laptop CPU decodes a few tokens a second), and a failed summary at the context's end is a turn
the proxy cannot keep going. So the deadline follows the rate the engine was seen to decode at.
Pure: the caller measures (tokens, seconds) and asks for the deadline.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Answers shorter than this say more about the request's overhead than about decoding.
MIN_MEASURED_TOKENS = 8
# The deadline allows this many times the measured decoding time: the engine may be busier when
# the summary runs than when it was measured (other slots, a prefill of its own).
SLACK = 3.0
# The latest answers measured per model: the slowest of them sets the pace.
KEPT = 8


@dataclass
class DecodeRates:
    """Per model, the tokens per second its latest answers were decoded at (lowest first counts)."""

    _rates: dict[str, deque[float]] = field(default_factory=dict)

    def observe(self, model: str | None, completion_tokens: int, seconds: float) -> None:
        """One answer: ``completion_tokens`` generated in ``seconds`` (from the request's sending, or
        from a stream's first token, to its end). Time spent on the prompt makes it slower than
        decoding alone: a cautious figure, which is what a deadline needs."""
        if model is None or completion_tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        self._rates.setdefault(model, deque(maxlen=KEPT)).append(completion_tokens / seconds)

    def rate(self, model: str | None) -> float | None:
        """The slowest of the model's latest measured rates (tokens/s), None before any."""
        rates = self._rates.get(model) if model is not None else None
        return min(rates) if rates else None

    def deadline(self, model: str | None, max_tokens: int, floor_s: float) -> float:
        """Seconds to wait for a summary of up to ``max_tokens``: ``floor_s`` (the configured
        ``summarizer.timeout_s``), or longer where the engine was seen to decode too slowly to
        finish within it."""
        rate = self.rate(model)
        if rate is None:
            return floor_s
        return max(floor_s, SLACK * max_tokens / rate)
