"""History tool calls restored to the exact ids and argument bytes the backend generated.

Some clients (Dify's function-calling agent) rebuild history tool calls with
fresh uuid4 ids and re-serialized arguments on every request, so the history
misses the cache after the first tool call. The proxy relayed the original
calls, so it remembers them keyed by where they occur in the conversation:
tenant, the user message that started the turn, the assistant message's
ordinal after it, the call's index, its function name and canonical arguments.
Only where the original is unknown does a deterministic id derived from the
same key replace the client's, in the call and in its tool results alike.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from proxy.canon.actions import Action
from proxy.canon.jsoncanon import canonical_arguments
from proxy.tokenization.counter import message_text

K = TypeVar("K", int, str)


@dataclass(frozen=True, slots=True)
class GeneratedCall:
    id: str
    arguments: str


class ToolCallMemory:
    """Bounded LRU of tool calls the backend generated, by position key and by their own id."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self._entries: OrderedDict[int, GeneratedCall] = OrderedDict()
        self._by_id: OrderedDict[str, GeneratedCall] = OrderedDict()
        self._max_entries = max_entries

    def remember(self, key: int, call: GeneratedCall) -> None:
        _put(self._entries, key, call, self._max_entries)
        _put(self._by_id, call.id, call, self._max_entries)

    def recall(self, key: int) -> GeneratedCall | None:
        call = self._entries.get(key)
        if call is not None:
            self._entries.move_to_end(key)
        return call

    def by_id(self, call_id: Any) -> GeneratedCall | None:
        """The call the backend generated with this id, when the client kept the original id."""
        return self._by_id.get(call_id) if isinstance(call_id, str) else None

    def __len__(self) -> int:
        return len(self._entries)


def _put(table: OrderedDict[K, GeneratedCall], key: K, call: GeneratedCall, limit: int) -> None:
    table[key] = call
    table.move_to_end(key)
    if len(table) > limit:
        table.popitem(last=False)


def call_key(namespace: str, anchor: int, ordinal: int, index: int, name: str, arguments: Any) -> int:
    digest = xxhash.xxh3_64()
    for part in (namespace, str(anchor), str(ordinal), str(index), name, canonical_arguments(arguments)):
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.intdigest()


def _anchor(message: dict[str, Any]) -> int:
    return xxhash.xxh3_64_intdigest(message_text(message).encode("utf-8", "surrogatepass"))


def iter_call_positions(messages: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """(message index, anchor, ordinal) for every assistant message, in order."""
    positions: list[tuple[int, int, int]] = []
    anchor, ordinal = 0, 0
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "user":
            anchor, ordinal = _anchor(message), 0
        elif role == "assistant":
            positions.append((index, anchor, ordinal))
            ordinal += 1
    return positions


def next_assistant_position(messages: list[dict[str, Any]]) -> tuple[int, int]:
    """(anchor, ordinal) the assistant reply to ``messages`` will have in the next request."""
    anchor, ordinal = 0, 0
    for message in messages:
        role = message.get("role")
        if role == "user":
            anchor, ordinal = _anchor(message), 0
        elif role == "assistant":
            ordinal += 1
    return anchor, ordinal


def restore_tool_calls(messages: list[dict[str, Any]], namespace: str, memory: ToolCallMemory | None) -> list[Action]:
    """Rewrite history tool calls in place (messages must be copies the caller owns)."""
    renamed: dict[str, str] = {}
    restored = derived = arguments_restored = 0
    for index, anchor, ordinal in iter_call_positions(messages):
        calls = messages[index].get("tool_calls")
        if not isinstance(calls, list) or not calls:
            continue
        new_calls = []
        for position, call in enumerate(calls):
            if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
                new_calls.append(call)
                continue
            function = call["function"]
            name = str(function.get("name", ""))
            key = call_key(namespace, anchor, ordinal, position, name, function.get("arguments", ""))
            old_id = call.get("id")
            # A client that kept the backend's own id identifies the call exactly; the position key
            # can collide between conversations that happen to ask the same thing.
            original = (memory.by_id(old_id) or memory.recall(key)) if memory is not None else None
            call = {**call}
            if original is not None:
                new_id = original.id
                if original.arguments != function.get("arguments"):
                    call["function"] = {**function, "arguments": original.arguments}
                    arguments_restored += 1
                if new_id != old_id:
                    restored += 1
            else:
                new_id = f"call_{key:016x}"
                if new_id != old_id:
                    derived += 1
            if isinstance(old_id, str) and old_id != new_id:
                renamed[old_id] = new_id
            call["id"] = new_id
            new_calls.append(call)
        messages[index] = {**messages[index], "tool_calls": new_calls}
    if renamed:
        for index, message in enumerate(messages):
            if message.get("role") == "tool" and message.get("tool_call_id") in renamed:
                messages[index] = {**message, "tool_call_id": renamed[message["tool_call_id"]]}
    actions = []
    if restored:
        actions.append(Action("tool_call_ids_restored", str(restored)))
    if arguments_restored:
        actions.append(Action("tool_call_arguments_restored", str(arguments_restored)))
    if derived:
        actions.append(Action("tool_call_ids_derived", str(derived)))
    return actions


def remember_generated_calls(
    messages: list[dict[str, Any]],
    namespace: str,
    calls: list[tuple[str, str, str]],
    memory: ToolCallMemory,
) -> None:
    """Remember the (id, name, arguments) calls the backend generated in reply to ``messages``."""
    anchor, ordinal = next_assistant_position(messages)
    for position, (call_id, name, arguments) in enumerate(calls):
        key = call_key(namespace, anchor, ordinal, position, name, arguments)
        memory.remember(key, GeneratedCall(id=call_id, arguments=arguments))
