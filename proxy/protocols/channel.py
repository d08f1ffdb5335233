"""How the summarizer's request for a conversation reaches the backend: in the conversation's protocol.

The summarization request is the conversation as forwarded plus an instruction, so that its
prefix hits the blocks the conversation left in the cache. That holds only if the backend renders
it exactly as it rendered the conversation, which for a conversation held in another protocol
(Anthropic Messages, Responses) means sending it in that protocol, through the same conversion.
"""

from __future__ import annotations

from typing import Any, Protocol

from proxy.openai import Usage


class SummaryChannel(Protocol):
    #: upstream path under the API base (``/chat/completions``)
    path: str

    def request(self, chat_body: dict[str, Any]) -> dict[str, Any]:
        """The protocol's body for a chat-shaped summarization request (unsalted)."""
        ...

    def reply(self, answer: Any) -> tuple[str, Usage | None]:
        """The summary text and usage of the upstream's JSON answer (KeyError/TypeError if unreadable)."""
        ...


class ChatChannel:
    path = "/chat/completions"

    def request(self, chat_body: dict[str, Any]) -> dict[str, Any]:
        return chat_body

    def reply(self, answer: Any) -> tuple[str, Usage | None]:
        text = answer["choices"][0]["message"]["content"] or ""
        return str(text), Usage.from_openai(answer.get("usage"))


CHAT = ChatChannel()
