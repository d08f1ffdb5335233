"""What every generation protocol gives the chat pipeline: one interface, three classes.

A protocol (chat completions, Anthropic Messages, Responses) is one :class:`GenerationProtocol`:
it validates the client's body, gives a chat-shaped *view* of it (which canonicalization, sessions,
summaries and budgets work on) that maps the canonical view back onto the client's own body, reads
the backend's answer (usage, the assistant's reply, its stream's events) and says how the
summarizer's request for the conversation is sent in the same protocol. The pipeline
(``proxy.routes.pipeline``) holds no protocol's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import xxhash
from cachetools import LRUCache

from proxy.canon import ToolOrders
from proxy.http import OPENAI, ErrorDialect, SSERelay
from proxy.openai import AssistantRecorder, Usage, loads, shared_json
from proxy.protocols.channel import SummaryChannel
from summarizer import RENDERING_FIELDS


class ProtocolView(Protocol):
    """A request seen as chat: ``chat`` is the view, ``restore`` maps a canonical view back onto
    the client's body (byte-identical wherever nothing changed), ``position`` names where a view
    message came from in the client's body (its message or input item, and content block)."""

    chat: dict[str, Any]
    actions: list[str]

    def restore(self, forwarded: dict[str, Any]) -> dict[str, Any]: ...

    def position(self, index: int) -> tuple[int | str | None, int | None]: ...


@dataclass(frozen=True)
class DiagnosticsAsk:
    """A client's request for cache diagnostics, and the earlier answer it names (None: none yet,
    as Anthropic's ``previous_message_id: null`` on a conversation's first turn)."""

    previous_id: str | None


@dataclass(frozen=True)
class Diagnosis:
    """What the proxy found, for a protocol to answer in its hosted shape.

    ``outcome``: ``hit`` (the prompt starts with the earlier one), ``miss`` (``changed`` says what
    changed first: model, system, tools, messages, or compacted when the difference is the
    proxy's summary), ``not_found`` (the earlier answer is not the tenant's, or is forgotten),
    ``unavailable`` (the explanation is off), ``not_compared`` (no earlier answer named). Where
    the prompts first differ: the client's ``message`` (an index; ``"system"``,
    ``"instructions"`` or ``"tools"`` for what is not in the message list), its content ``block``,
    the system prompt's ``line`` and about which ``token``."""

    outcome: Literal["hit", "miss", "not_found", "unavailable", "not_compared"]
    changed: str | None = None
    missed_tokens: int = 0
    reusable_tokens: int = 0
    message: int | str | None = None
    block: int | None = None
    line: int | None = None
    token: int | None = None

    def divergence(self) -> dict[str, Any]:
        where = {"message": self.message, "block": self.block, "line": self.line, "token": self.token}
        return {key: value for key, value in where.items() if value is not None}


class GenerationProtocol:
    """One protocol's generation endpoint, as the chat pipeline sees it."""

    #: the route's name in metrics and the access log
    route: ClassVar[str]
    #: the upstream path under the API base
    path: ClassVar[str]
    #: how errors read on this route
    dialect: ClassVar[ErrorDialect] = OPENAI
    #: reads the protocol's stream events
    relay_class: ClassVar[type[SSERelay]] = SSERelay
    #: the list a successful whole answer holds (its choices, content blocks, output items)
    answer_list: ClassVar[str]

    def validate(self, body: dict[str, Any], namespace: str | None = None) -> None:
        """Refuse (InvalidRequest) what the backend would refuse, before anything is derived from it.
        ``namespace``: the tenant, whose conversation's messages checked before need no check again."""
        raise NotImplementedError

    def view(self, body: dict[str, Any], tool_orders: ToolOrders | None, namespace: str) -> ProtocolView:
        raise NotImplementedError

    def stream_request(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """A stream request as sent upstream (asking for the usage where the protocol makes it
        optional), and whether the client asked for the usage itself."""
        return body, True

    def read_usage(self, usage: Any) -> Usage | None:
        raise NotImplementedError

    def reply_of(self, answer: Any) -> AssistantRecorder | None:
        """The assistant's reply in a whole answer; None when the answer holds none."""
        raise NotImplementedError

    def channel(self, view: Any) -> SummaryChannel:
        raise NotImplementedError

    # -- cache diagnostics ---------------------------------------------------------------------

    def diagnostics_asked(self, body: dict[str, Any]) -> tuple[dict[str, Any], DiagnosticsAsk | None]:
        """The body without the protocol's diagnostics request (the proxy answers it; a backend
        may not know it), and that request; None when the client asked for none."""
        return openai_diagnostics_asked(body)

    def diagnostics_fields(self, diagnosis: Diagnosis) -> dict[str, Any]:
        """The fields the answer object gets for ``diagnosis``, in the protocol's hosted shape."""
        return openai_diagnostics_fields(diagnosis)


# The chat view of tool lists seen before, by tenant and the list's JSON: a client re-sends the same
# tools on every request, and their view (schemas with keys sorted at every level) is made once.
_TOOL_VIEWS: LRUCache[tuple[str, Callable[[Any], Any], int], tuple[Any, ...]] = LRUCache(1024)


def tool_views(tools: list[Any], view: Callable[[Any], Any], namespace: str) -> list[Any]:
    """``[view(tool) for tool in tools]``, made once per distinct list (``namespace``: the tenant, so
    that no tenant's request is faster for another's). ``view`` is one function per cache user (a
    protocol's), pure; what it made is shared by the requests that send the same list, as the
    canonical tools are (``proxy.canon.tools``): nothing changes a request's tools in place.

    Keyed by the list's orjson bytes, which tell two lists apart except where orjson writes two
    values alike: a NaN or an infinity (accepted by the standard library's parser) is written as
    ``null``, so a list whose JSON holds a ``null`` is viewed afresh."""
    raw = shared_json(tools)
    if raw is None:  # what orjson refuses (a lone surrogate, an integer past 64 bits)
        return [view(tool) for tool in tools]
    if b"null" in raw:
        return [view(tool) for tool in tools]
    key = (namespace, view, xxhash.xxh3_128_intdigest(raw))
    found = _TOOL_VIEWS.get(key)
    if found is None:
        found = _TOOL_VIEWS[key] = tuple(view(tool) for tool in tools)
    return list(found)


def texts(content: Any) -> list[str]:
    """The text parts of a message's content (a string, or a list of ``{"type": "text"}`` parts)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return []


def event_payloads(block: bytes) -> Iterator[Any]:
    """The JSON payload of each event in a block of complete SSE events (those that parse)."""
    for event in block.split(b"\n\n"):
        start = event.find(b"data: {")
        if start < 0:
            continue
        try:
            yield loads(event[start + 6 :].split(b"\n", 1)[0])
        except ValueError:
            continue


def summary_options(body: dict[str, Any], original: dict[str, Any], tool_choice_none: Any) -> None:
    """What a summary request keeps of the conversation's body so that it renders alike: its tools
    (with no tool to be called), what the template reads (``RENDERING_FIELDS``) and its cache salt."""
    tools = original.get("tools")
    if tools:
        body["tools"] = tools
        body["tool_choice"] = tool_choice_none
    for key in RENDERING_FIELDS:
        if original.get(key) is not None:
            body[key] = original[key]
    if original.get("cache_salt"):
        body["cache_salt"] = original["cache_salt"]


# OpenAI's shape (Responses' ``prompt_cache_options.comparison_response_id`` and
# ``prompt_cache_diagnostics``, which the proxy also answers on chat completions).
_OPENAI_REASONS = {
    "model": "model_changed",
    "tools": "tools_changed",
    "system": "input_changed",
    "messages": "input_changed",
    "compacted": "context_compacted",
}


def openai_diagnostics_asked(body: dict[str, Any]) -> tuple[dict[str, Any], DiagnosticsAsk | None]:
    options = body.get("prompt_cache_options")
    if not isinstance(options, dict) or "comparison_response_id" not in options:
        return body, None
    previous = options.get("comparison_response_id")
    rest = {key: value for key, value in options.items() if key != "comparison_response_id"}
    body = {key: value for key, value in body.items() if key != "prompt_cache_options"}
    if rest:
        body["prompt_cache_options"] = rest
    return body, DiagnosticsAsk(previous if isinstance(previous, str) and previous else None)


def openai_diagnostics_fields(diagnosis: Diagnosis) -> dict[str, Any]:
    found: dict[str, Any]
    if diagnosis.outcome == "hit":
        found = {"type": "cache_hit"}
    elif diagnosis.outcome == "miss":
        found = {
            "type": "cache_miss",
            "reason": _OPENAI_REASONS.get(diagnosis.changed or "", "input_changed"),
            "cache_missed_tokens": diagnosis.missed_tokens,
            "comparison_reusable_tokens": diagnosis.reusable_tokens,
            "divergence": diagnosis.divergence(),
        }
    elif diagnosis.outcome in ("not_found", "not_compared"):
        found = {"type": "comparison_response_not_found"}
    else:
        found = {"type": "unavailable"}
    return {"prompt_cache_diagnostics": found}
