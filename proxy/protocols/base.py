"""What every generation protocol gives the chat pipeline: one interface, three classes.

A protocol (chat completions, Anthropic Messages, Responses) is one :class:`GenerationProtocol`:
it validates the client's body, gives a chat-shaped *view* of it (which canonicalization, sessions,
summaries and budgets work on) that maps the canonical view back onto the client's own body, reads
the backend's answer (usage, the assistant's reply, its stream's events) and says how the
summarizer's request for the conversation is sent in the same protocol. The pipeline
(``proxy.routes.pipeline``) holds no protocol's name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

from proxy.canon.tools import ToolOrders
from proxy.http.dialect import OPENAI, ErrorDialect
from proxy.http.relay import SSERelay
from proxy.openai.assistant import AssistantRecorder
from proxy.openai.jsonio import loads
from proxy.openai.usage import Usage
from proxy.protocols.channel import SummaryChannel


class ProtocolView(Protocol):
    """A request seen as chat: ``chat`` is the view, ``restore`` maps a canonical view back onto
    the client's body (byte-identical wherever nothing changed)."""

    chat: dict[str, Any]
    actions: list[str]

    def restore(self, forwarded: dict[str, Any]) -> dict[str, Any]: ...


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

    def validate(self, body: dict[str, Any]) -> None:
        """Refuse (InvalidRequest) what the backend would refuse, before anything is derived from it."""
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
    (with no tool to be called) and its cache salt."""
    tools = original.get("tools")
    if tools:
        body["tools"] = tools
        body["tool_choice"] = tool_choice_none
    if original.get("cache_salt"):
        body["cache_salt"] = original["cache_salt"]
