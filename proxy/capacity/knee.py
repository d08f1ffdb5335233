"""Where a ramp of input lengths stops scaling: the critical context length at a concurrency.

Pure: takes the measured steps, returns the knee. A step has kneed when, compared with the
steps before it at the same concurrency:

1. vLLM preempted requests (``vllm:num_preemptions_total`` rose): running sequences no longer
   fit in the KV pool, so some are evicted and recomputed later;
2. requests queued for a real share of their time to first token (``vllm:request_queue_time``):
   the pool (or the batch) could not admit them all at once;
3. only where the backend does not export those two (the fake backend, other servers): the
   slowest request's time to first token per prompt token at least doubled against the best
   earlier step: some request waited for another's blocks (the curve's knee even where vLLM's
   counters are missing; the slowest request, because the median hides the few that wait).

The critical context length is the longest input of the steps before the knee. vLLM's own
counters win over the client's clock when present: on a busy machine one slow prefill doubles a
step's TTFT without any KV pressure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

QUEUE_SHARE = 0.25
TTFT_FACTOR = 2.0


@dataclass
class Step:
    concurrency: int
    input_tokens: int
    prompt_tokens: float = 0.0  # measured mean (usage)
    ttft_p50: float = 0.0
    ttft_max: float = 0.0
    e2e_p50: float = 0.0
    output_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    kv_usage_max: float = 0.0
    waiting_max: float = 0.0
    preemptions: float = 0.0
    queue_s_mean: float = 0.0
    prefill_s_mean: float = 0.0
    decode_s_mean: float = 0.0
    errors: int = 0

    def to_json(self) -> dict[str, float | int]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Knee:
    concurrency: int
    # Longest input that ran before the knee (None: the first step already kneed).
    critical_context: int | None
    knee_input: int | None
    reason: str | None  # "preemptions", "queueing", "ttft", None (no knee within the ramp)


def step_knee(step: Step, earlier: Sequence[Step], engine_signals: bool = True) -> str | None:
    if step.errors:
        return "errors"
    if step.preemptions > 0:
        return "preemptions"
    if step.ttft_p50 > 0 and step.queue_s_mean > QUEUE_SHARE * step.ttft_p50 and step.waiting_max > 0:
        return "queueing"
    if engine_signals:
        return None
    rates = [s.ttft_max / s.prompt_tokens for s in earlier if s.prompt_tokens > 0 and s.ttft_max > 0]
    if rates and step.prompt_tokens > 0 and step.ttft_max / step.prompt_tokens > TTFT_FACTOR * min(rates):
        return "ttft"
    return None


def find_knee(steps: Sequence[Step], engine_signals: bool = True) -> Knee:
    """``steps`` of one concurrency; ``engine_signals``: the backend exports preemptions and queue time."""
    ordered = sorted(steps, key=lambda s: s.input_tokens)
    concurrency = ordered[0].concurrency if ordered else 0
    for index, step in enumerate(ordered):
        reason = step_knee(step, ordered[:index], engine_signals)
        if reason is not None:
            critical = ordered[index - 1].input_tokens if index else None
            return Knee(concurrency, critical, step.input_tokens, reason)
    return Knee(concurrency, ordered[-1].input_tokens if ordered else None, None, None)
