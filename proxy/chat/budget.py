"""Token budgets: pure decisions, no I/O (the store applies them atomically).

Context budget (per request): the tokens a session may send. Hard limit =
``context_limit_tokens`` if configured, else the model's ``max_model_len`` minus
the request's ``max_tokens`` (at most a quarter of the context: vLLM clamps it).
Crossing ``soft_ratio`` of it marks the session due for compaction (and, over the
limit, compacted before it is sent). Only a configured ``context_limit_tokens`` is enforced by the proxy (400
``context_length_exceeded``); over the limit derived from the model the request
is forwarded, for the engine to judge: the proxy is never stricter than it.

Usage budget (per session and per tenant, over a fixed time window): a request
is admitted only if its reservation fits under every limit: the most its prompt
can be (:func:`prompt_ceiling`, or the backend's exact count near the limit)
plus, for each completion it asks for (``n``, ``best_of``, read as the engine
reads them: ``proxy.http.reading``), ``max_tokens``, or without it what the engine
may generate (to the end of the model's context; ``completion_reserve_tokens``
only where the context is unknown). The reservation is corrected to the real
usage when the request ends. Admission is atomic, so concurrent requests never
reserve past a limit, on any number of replicas. A request whose reservation is
a true upper bound cannot spend more than it reserved, so the limit is never
exceeded while the model's context is known.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any

from proxy.backends import OPENAI_LIMIT_FIELDS
from proxy.config import BudgetOverrides, BudgetSettings, Settings
from proxy.openai import Continuations, Usage, dumps, message_text, shared_dumps, utf8_size
from proxy.sessions import UsageLimit, slot_tag
from proxy.tokenization import CAUTIOUS_TOKENS_PER_BYTE, TokenCounter

_Layers = tuple[BudgetSettings, BudgetOverrides | None, BudgetOverrides | None]
# Budgets by the settings objects they come from, which are kept with them (an id is not reused
# while cached). Settings do not change while the proxy runs, and copying pydantic models on every
# request cost more than the rest of the budget decision. A handful of entries: models x tenants.
_effective: dict[tuple[int, int, int], tuple[_Layers, BudgetSettings]] = {}
MAX_CACHED_BUDGETS = 1024


def budget_for(settings: Settings, model: str, tenant_overrides: BudgetOverrides | None) -> BudgetSettings:
    """The budget a request for ``model`` runs under: the settings', the model's, the tenant's."""
    return effective_budget(settings.budget, settings.model_budgets.get(model), tenant_overrides)


def effective_budget(
    base: BudgetSettings, model_overrides: BudgetOverrides | None, tenant_overrides: BudgetOverrides | None
) -> BudgetSettings:
    """Global settings, then the model's overrides, then the tenant's (most specific wins)."""
    if model_overrides is None and tenant_overrides is None:
        return base
    layers = (base, model_overrides, tenant_overrides)
    key = (id(base), id(model_overrides), id(tenant_overrides))
    cached = _effective.get(key)
    if cached is not None and all(a is b for a, b in zip(cached[0], layers, strict=True)):
        return cached[1]
    budget = base
    for overrides in (model_overrides, tenant_overrides):
        if overrides is not None:
            budget = overrides.apply_to(budget)
    if len(_effective) >= MAX_CACHED_BUDGETS:
        _effective.clear()
    _effective[key] = (layers, budget)
    return budget


def requested_completion_tokens(body: dict[str, Any], fields: tuple[str, ...] = OPENAI_LIMIT_FIELDS) -> int | None:
    """The completion limit: the first of ``fields`` (the engine's: ``max_completion_tokens``, else
    ``max_tokens``) the body sets. A 0 in ``max_completion_tokens`` is passed over: vLLM refuses it,
    and an engine that reads ``max_completion_tokens or max_tokens`` generates ``max_tokens`` then."""
    for key in fields:
        value = body.get(key)
        if isinstance(value, int) and value >= 0 and not (value == 0 and key == "max_completion_tokens"):
            return value
    return None


def spent_when_cut_short(usage: Usage | None, prompt_estimate: int, tokens_relayed: int, reserved: int | None) -> int:
    """What a stream that stopped short spent. With the engine's report: at least the prompt it
    reported and what the events relayed could carry (a report made on the way, as Anthropic's
    ``message_start``, says no output yet), its own total where that is more. Without one: the prompt
    estimate and the relayed tokens. Never more than was reserved unless the engine reported more."""
    if usage is None:
        spent = prompt_estimate + tokens_relayed
        return min(spent, reserved) if reserved is not None else spent
    spent = usage.prompt_tokens + max(usage.completion_tokens, tokens_relayed)
    if reserved is not None:
        spent = min(spent, reserved)
    return max(spent, usage.total_tokens)


def tokens_per_event(body: dict[str, Any]) -> int:
    """Tokens a streamed event may carry: vLLM's ``stream_interval`` where the request sets it (an
    event every that many tokens), else one. What a stream cut short is charged for each event it
    relayed, the engine's usage never having come."""
    value = body.get("stream_interval")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


# vLLM clamps max_tokens to what the context leaves after the prompt, so a max_tokens that asks for
# most of the context (Claude Code sends 32000, to a 32k model too) promises no room for the answer:
# of a limit derived from the model it reserves at most this share. Without the cap every request
# of such a client would count as over its context budget and be compacted on every turn.
MAX_OUTPUT_SHARE = 0.25


def context_limit(
    budget: BudgetSettings, max_model_len: int | None, body: dict[str, Any], *, answer_room: bool = True
) -> int | None:
    """The request's context budget: ``context_limit_tokens``, else the model's context less the
    room its answer asks for (at most :data:`MAX_OUTPUT_SHARE` of it) where the engine refuses a
    prompt without that room (``answer_room``), else less the one token the engine needs past it."""
    if budget.context_limit_tokens is not None:
        return budget.context_limit_tokens
    if max_model_len is None:
        return None
    if not answer_room:
        return max_model_len - 1
    reserve = min(requested_completion_tokens(body) or 0, int(max_model_len * MAX_OUTPUT_SHARE))
    return max_model_len - reserve


# Before a session has ground truth the fast estimate uses CAUTIOUS_TOKENS_PER_BYTE: 2 bytes a token
# over-estimates English (about 4 bytes a token) and is close for CJK text (about 2-3), so it errs high.
# Below this share of a limit the fast estimate is trusted; above it the text is tokenized.
EXACT_COUNT_MARGIN = 0.85


# Request fields a chat template may render besides the messages and tools: vLLM hands
# ``chat_template_kwargs`` (any variable a template reads) and ``documents`` (Command R's and
# Granite's templates render retrieved documents) to the template. Their JSON bounds what they add.
TEMPLATE_FIELDS = ("chat_template_kwargs", "documents")


def request_bytes(body: dict[str, Any], sizes: RequestSizes | None = None, tenant: str = "") -> int:
    """UTF-8 size of everything a chat template renders from the request (text and tools).
    ``sizes``: the messages' sizes kept per conversation, where the request's are looked up."""
    messages = body.get("messages") or []
    size = sizes.of_messages(tenant, messages) if sizes is not None else message_ends(messages)[-1]
    tools = body.get("tools") or body.get("functions")
    if tools:
        size += len(shared_dumps(tools))  # not orjson.dumps: it refuses lone surrogates, which clients may send
    for field in TEMPLATE_FIELDS:
        value = body.get(field)
        if value:
            size += len(dumps(value))
    return size


def message_ends(messages: list[Any], resumed: array[int] | None = None, shared: int = 0) -> array[int]:
    """``ends[i]``: the size of ``messages[:i]`` as :func:`request_bytes` counts it; ``resumed``: the
    ends of a list whose first ``shared`` messages equal these (:mod:`proxy.openai.continuation`)."""
    ends = resumed[: shared + 1] if resumed is not None and shared else array("Q", [0])
    total = ends[-1]
    for message in messages[len(ends) - 1 :]:
        total += utf8_size(message_text(message)) + 8
        ends.append(total)
    return ends


class RequestSizes:
    """The messages' part of :func:`request_bytes`, kept per tenant and conversation: a request
    sizes only the messages it adds to its conversation's last one."""

    def __init__(self, forwarded: Continuations[Any] | None = None) -> None:
        # ``forwarded``: the memory shared with the other parts that read these messages.
        self._forwarded: Continuations[Any] = forwarded if forwarded is not None else Continuations()

    def of_messages(self, tenant: str, messages: list[Any]) -> int:
        return self.ends_of(tenant, messages)[-1]

    def ends_of(self, tenant: str, messages: list[Any]) -> array[int]:
        """:func:`message_ends` of the messages (not to be changed)."""
        resumed = self._forwarded.resume(tenant, messages, "sizes")
        ends = message_ends(messages, resumed.state, resumed.shared)
        resumed.keep(messages, ends)
        return ends


def fast_estimate(size_bytes: int, tokens_per_byte: float | None) -> int:
    return math.ceil(size_bytes * (tokens_per_byte or CAUTIOUS_TOKENS_PER_BYTE))


def near_limit(estimate: int, limit: int | None) -> bool:
    return limit is not None and estimate > limit * EXACT_COUNT_MARGIN


def estimate_prompt_tokens(
    counter: TokenCounter, body: dict[str, Any], size_bytes: int, tokens_per_byte: float | None, limit: int | None
) -> int:
    """Prompt tokens of a request, as cheaply as the decision allows.

    Tokenizing 8k tokens costs about 10 ms, far more than the proxy may add, so the
    byte size (scaled by the session's measured tokens per byte, the upstream's
    usage being ground truth) decides alone unless it comes near ``limit``; only
    then is the text tokenized (tiktoken, offline, memoized per message).
    """
    estimate = fast_estimate(size_bytes, tokens_per_byte)
    if not near_limit(estimate, limit):
        return estimate
    messages = body.get("messages") or []
    exact = counter.count_messages(messages) + counter.count_tools(body.get("tools") or body.get("functions"))
    # The local tokenizer is not the model's: a calibrated byte estimate that is higher wins.
    return max(exact, estimate) if tokens_per_byte else exact


@dataclass(frozen=True)
class ContextCheck:
    estimate: int
    limit: int | None

    @property
    def over_hard(self) -> bool:
        return self.limit is not None and self.estimate > self.limit


def check_context(estimate: int, limit: int | None) -> ContextCheck:
    # Whether a session is due for compaction is summarizer.policy.is_due's call, not this one's.
    return ContextCheck(estimate, limit)


def usage_limits(budget: BudgetSettings, tenant: str, session_id: str | None) -> list[UsageLimit]:
    limits: list[UsageLimit] = []
    if budget.tenant_tokens_per_window is None and budget.session_tokens_per_window is None:
        return limits
    # One admission checks both counters in one atomic step: on a Redis Cluster they must share a
    # hash slot, hence the tenant's tag in both keys.
    scope = slot_tag(tenant)
    if budget.tenant_tokens_per_window is not None:
        limits.append(UsageLimit(f"t:{scope}", budget.tenant_tokens_per_window, "tenant"))
    if budget.session_tokens_per_window is not None and session_id:
        limits.append(UsageLimit(f"s:{scope}:{session_id}", budget.session_tokens_per_window, "session"))
    return limits


# Every token of a prompt's text covers at least one of its UTF-8 bytes (byte-level BPE, and
# SentencePiece with byte fallback), so the text's size bounds its tokens. A chat template adds a
# few per message (role headers, separators; one more for SentencePiece's leading space) and a
# block of its own (a default system line, the tool-calling instructions).
TEMPLATE_TOKENS_PER_MESSAGE = 16
TEMPLATE_TOKENS = 512
# Beside the backend's exact count (POST /tokenize renders the chat template as chat completions
# does; another protocol's rendering of the same conversation may differ by a few tokens).
EXACT_COUNT_SLACK = 32


def prompt_ceiling(size_bytes: int, message_count: int) -> int:
    """The most tokens a prompt of ``size_bytes`` (:func:`request_bytes`) in ``message_count``
    messages can be, whatever the model's tokenizer: what a reservation must cover to be a bound."""
    return size_bytes + message_count * TEMPLATE_TOKENS_PER_MESSAGE + TEMPLATE_TOKENS


_ABSENT = object()


def completions_requested(body: dict[str, Any]) -> int:
    """How many completions the backend generates for the request: ``n``, or ``best_of`` where it
    is larger (vLLM generates best_of and returns n of them)."""
    count = 1
    for key in ("n", "best_of", "n_cmpl"):  # n_cmpl: llama-server's, read before n
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > count:
            count = value
    return count


def completion_allowance(
    body: dict[str, Any],
    budget: BudgetSettings,
    engine_context: int | None = None,
    *,
    engine_default: int | None = None,
    fields: tuple[str, ...] = OPENAI_LIMIT_FIELDS,
) -> int:
    """Completion tokens a reservation holds: per completion, ``max_tokens`` (or llama.cpp's
    ``n_predict``, where larger); without it what the engine generates then: ``engine_default``
    where its protocol has one (vLLM's completions: 16), else up to the end of the context
    (``engine_context``, the model's ``max_model_len``), and ``completion_reserve_tokens`` only
    where the context is unknown; for every completion requested. ``fields``: those the engine
    reads for the limit (``proxy.backends.limit_fields``): one it ignores limits nothing."""
    completion = requested_completion_tokens(body, fields)
    if completion is None:
        # An explicit null is no default: vLLM generates to the context's end then.
        default = engine_default if body.get("max_tokens", _ABSENT) is _ABSENT else None
        completion = default if default is not None else engine_context
    native = _n_predict(body)
    if native is not None:
        # llama.cpp's own limit, which llama-server reads before max_tokens (a negative one: until
        # the context is full). The reservation is made before the engine is known: the larger.
        bound = native if native >= 0 else engine_context or budget.completion_reserve_tokens
        completion = max(completion or 0, bound)
    per_choice = completion if completion is not None else budget.completion_reserve_tokens
    return per_choice * completions_requested(body)


def _n_predict(body: dict[str, Any]) -> int | None:
    """``n_predict`` as llama-server reads it (nlohmann's ``get<int>``: a number, a fraction cut; not
    a bool or a string, which it ignores for ``max_tokens``)."""
    value = body.get("n_predict")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if math.isfinite(value) else -1


def reservation_amount(
    prompt_tokens: int,
    body: dict[str, Any],
    budget: BudgetSettings,
    engine_context: int | None = None,
    fields: tuple[str, ...] = OPENAI_LIMIT_FIELDS,
) -> int:
    """The most a request can spend: its prompt and every completion's allowance (its limit read
    from ``fields``); with the engine's context known, at most the context per completion (a
    completion's prompt and answer fit in it: the prompt plus ``n`` answers of at most the context
    less the prompt is at most ``n`` contexts)."""
    amount = prompt_tokens + completion_allowance(body, budget, engine_context, fields=fields)
    if engine_context:
        amount = min(amount, engine_context * completions_requested(body))
    return amount
