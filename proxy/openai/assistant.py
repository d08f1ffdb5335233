"""What the backend generated for one response: text and tool calls, byte for byte.

The proxy relays the model's output, so it can remember the exact ids and
argument strings of tool calls and restore them when a client re-sends history
in another byte form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class AssistantRecorder:
    content_parts: list[str] = field(default_factory=list)
    tool_calls: dict[int, ToolCall] = field(default_factory=dict)

    def feed_delta(self, choice: Any) -> None:
        """Accumulate one streamed ``choices[i]`` entry (only choice 0 is the conversation)."""
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            return
        delta = choice.get("delta")
        if isinstance(delta, dict):
            self._feed(delta, streaming=True)

    def feed_message(self, message: Any) -> None:
        if isinstance(message, dict):
            self._feed(message, streaming=False)

    def _feed(self, message: dict[str, Any], *, streaming: bool) -> None:
        # What the upstream sends is checked type by type: a malformed chunk is skipped, never
        # allowed to break the relay.
        content = message.get("content")
        if isinstance(content, str):
            self.content_parts.append(content)
        calls = message.get("tool_calls")
        if not isinstance(calls, list):
            return
        for position, call in enumerate(calls):
            if not isinstance(call, dict):
                continue
            index = call.get("index", position) if streaming else position
            if not isinstance(index, int) or isinstance(index, bool):
                continue
            entry = self.tool_calls.setdefault(index, ToolCall())
            if call.get("id") and isinstance(call["id"], str):
                entry.id = call["id"]
            function = call.get("function")
            if not isinstance(function, dict):
                continue
            if function.get("name") and isinstance(function["name"], str):
                entry.name = function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                entry.arguments = entry.arguments + arguments if streaming else arguments

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    def calls(self) -> list[ToolCall]:
        return [self.tool_calls[i] for i in sorted(self.tool_calls)]

    def message(self) -> dict[str, Any]:
        """The reply as the client will re-send it in its history."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls()
            ]
        return message
