"""Chat completions (``POST /v1/chat/completions``): the pipeline's own shape.

A chat completions request is its own chat view and the canonical view is what is sent; the
backend is asked for the stream's usage chunk, which is removed again for a client that did not
ask for it (``proxy.http.relay``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.canon import ToolOrders
from proxy.http import validate_chat_request
from proxy.openai import AssistantRecorder, Usage
from proxy.protocols.base import GenerationProtocol
from proxy.protocols.channel import CHAT, ChatChannel


@dataclass
class ChatView:
    chat: dict[str, Any]
    actions: list[str] = field(default_factory=list)

    def restore(self, forwarded: dict[str, Any]) -> dict[str, Any]:
        return forwarded

    def position(self, index: int) -> tuple[int | str | None, int | None]:
        return index, None


def with_upstream_usage(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body asking the upstream for the usage chunk, and whether the client asked for it itself."""
    options = body.get("stream_options")
    options = options if isinstance(options, dict) else {}
    return {**body, "stream_options": {**options, "include_usage": True}}, bool(options.get("include_usage"))


def reply_message(answer: Any) -> AssistantRecorder | None:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    recorder = AssistantRecorder()
    recorder.feed_message(choices[0].get("message"))
    return recorder


class ChatCompletions(GenerationProtocol):
    route = "chat"
    path = "/chat/completions"
    answer_list = "choices"

    def validate(self, body: dict[str, Any], namespace: str | None = None) -> None:
        validate_chat_request(body, namespace)

    def view(self, body: dict[str, Any], tool_orders: ToolOrders | None, namespace: str) -> ChatView:
        # The chat engine canonicalizes tools itself (the view is the request).
        return ChatView(body)

    def stream_request(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        return with_upstream_usage(body)

    def read_usage(self, usage: Any) -> Usage | None:
        return Usage.from_openai(usage)

    def reply_of(self, answer: Any) -> AssistantRecorder | None:
        return reply_message(answer)

    def channel(self, view: Any) -> ChatChannel:
        return CHAT


CHAT_COMPLETIONS = ChatCompletions()
