"""History tool calls restored to the exact ids and argument bytes the backend saw.

Some clients (Dify's function-calling agent) rebuild history tool calls with
fresh uuid4 ids and re-serialized arguments on every request, so the history
misses the cache after the first tool call. The proxy relayed the original
calls, so it remembers them keyed by where they occur in the conversation:
tenant, the user message that started the turn, the assistant message's
ordinal after it, the call's index, its function name and canonical arguments.
A call the proxy did not relay (it came from elsewhere, or from before a
restart) is forwarded as the client sent it the first time and remembered the
same way, so a later re-send with a fresh id gets those first bytes back. A
client that keeps its ids is never rewritten; the id changes in the call and in
its tool results alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from cachetools import LRUCache

from proxy.canon.actions import Action
from proxy.canon.layout import extend
from proxy.openai import Continuations, canonical_arguments, extend_links, message_text
from proxy.recent import peek


@dataclass(frozen=True, slots=True)
class GeneratedCall:
    id: str
    arguments: str


class ToolCallMemory:
    """Bounded LRU of tool calls the backend generated, by position key and by their own id
    (that one forgets the least recently remembered: looking a call up by id is no use)."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self._entries: LRUCache[int, GeneratedCall] = LRUCache(max_entries)
        self._by_id: LRUCache[str, GeneratedCall] = LRUCache(max_entries)
        # Per tenant and conversation, the anchors of the last request's messages (a pure function
        # of each message): the next request anchors only the messages it adds.
        self.anchored: Continuations[Anchors] = Continuations()

    def remember(self, key: int, call: GeneratedCall) -> None:
        self._entries[key] = call
        self._by_id[call.id] = call

    def recall(self, key: int) -> GeneratedCall | None:
        return self._entries.get(key)

    def by_id(self, call_id: Any) -> GeneratedCall | None:
        """The call the backend generated with this id, when the client kept the original id."""
        return peek(self._by_id, call_id) if isinstance(call_id, str) else None

    def __len__(self) -> int:
        return len(self._entries)


def call_key(namespace: str, anchor: int, ordinal: int, index: int, name: str, arguments: Any) -> int:
    """The hash of the parts, each followed by a NUL (one call: every call of a history is keyed on
    every request)."""
    parts = (namespace, str(anchor), str(ordinal), str(index), name, canonical_arguments(arguments), "")
    return xxhash.xxh3_64_intdigest("\x00".join(parts).encode("utf-8", "surrogatepass"))


def nth_key(key: int, occurrence: int) -> int:
    """The key of the ``occurrence``-th call at an identical position in one conversation (a user who
    repeats a question the model answers with the same call): each keeps its own id."""
    return key if occurrence == 0 else xxhash.xxh3_64_intdigest(f"{key}\x00{occurrence}".encode())


def _anchor(message: dict[str, Any]) -> int:
    return xxhash.xxh3_64_intdigest(message_text(message).encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class Anchors:
    """Each message's anchor (the hash of its text), and ``histories[i]``, the chain of the first
    ``i`` anchors: what names the texts of ``messages[:i]``, ids and argument bytes left out."""

    anchors: list[int]
    histories: list[int]


def anchors_of(messages: list[dict[str, Any]], resumed: Anchors | None = None, shared: int = 0) -> Anchors:
    """The :class:`Anchors` of ``messages``; ``resumed``: those of a list whose first ``shared``
    messages equal these (:mod:`proxy.openai.continuation`)."""
    if resumed is None:
        shared = 0
    anchors = resumed.anchors[:shared] if resumed is not None else []
    anchors.extend(map(_anchor, messages[shared:]))
    histories = resumed.histories[: shared + 1] if resumed is not None else [0]
    return Anchors(anchors, extend_links(histories, anchors[len(histories) - 1 :]))


def iter_call_positions(
    messages: list[dict[str, Any]], anchors: Sequence[int] | None = None
) -> list[tuple[int, int, int]]:
    """(message index, anchor, ordinal) for every assistant message, in order (``anchors``: each
    message's, where known)."""
    positions: list[tuple[int, int, int]] = []
    anchor, ordinal = 0, 0
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "user":
            anchor, ordinal = (anchors[index] if anchors is not None else _anchor(message)), 0
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
    if not any(message.get("tool_calls") for message in messages if message.get("role") == "assistant"):
        return []
    renamed: dict[str, str] = {}
    occurrences: Counter[int] = Counter()
    used: set[str] = set()
    restored = arguments_restored = 0
    if memory is not None:
        resumed = memory.anchored.resume(namespace, messages)
        known = anchors_of(messages, resumed.state, resumed.shared)
        resumed.keep(messages, known)
    else:
        known = anchors_of(messages)
    histories = known.histories

    for index, anchor, ordinal in iter_call_positions(messages, known.anchors):
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
            base = call_key(namespace, anchor, ordinal, position, name, function.get("arguments", ""))
            key = nth_key(base, occurrences[base])
            occurrences[base] += 1
            old_id = call.get("id")
            # A client that kept the backend's own id identifies the call exactly; the position key
            # can collide between conversations that happen to ask the same thing (harmless for calls
            # the backend generated: a client re-sending them with fresh ids has no ids of its own).
            # Calls the proxy did not relay are remembered under the whole history before them
            # (``forwarded_key``): restored only within the same conversation, never into another
            # that happens to ask the same thing (a client's own ids must stay its own).
            original = (
                (memory.by_id(old_id) or memory.recall(key) or memory.recall(extend(histories[index], key)))
                if memory is not None
                else None
            )
            if original is not None and original.id in used:
                original = None  # never two calls with one id in a request
            call = {**call}
            new_id: Any = old_id
            if original is not None:
                new_id = original.id
                if original.arguments != function.get("arguments"):
                    call["function"] = {**function, "arguments": original.arguments}
                    arguments_restored += 1
                if new_id != old_id:
                    restored += 1
            else:
                arguments = function.get("arguments")
                if memory is not None and isinstance(old_id, str) and isinstance(arguments, str):
                    memory.remember(extend(histories[index], key), GeneratedCall(id=old_id, arguments=arguments))
            if isinstance(old_id, str) and old_id != new_id:
                renamed[old_id] = new_id
            if new_id != old_id:
                call["id"] = new_id
            if isinstance(new_id, str):
                used.add(new_id)
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
    return actions


def remember_generated_calls(
    messages: list[dict[str, Any]],
    namespace: str,
    calls: list[tuple[str, str, str]],
    memory: ToolCallMemory,
) -> None:
    """Remember the (id, name, arguments) calls the backend generated in reply to ``messages``."""
    anchor, ordinal = next_assistant_position(messages)
    earlier = Counter(_base_keys(messages, namespace))
    for position, (call_id, name, arguments) in enumerate(calls):
        base = call_key(namespace, anchor, ordinal, position, name, arguments)
        memory.remember(nth_key(base, earlier[base]), GeneratedCall(id=call_id, arguments=arguments))


def _base_keys(messages: list[dict[str, Any]], namespace: str) -> list[int]:
    """The position keys of the history's calls (before telling repeated positions apart)."""
    keys = []
    for index, anchor, ordinal in iter_call_positions(messages):
        for position, call in enumerate(messages[index].get("tool_calls") or []):
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                function = call["function"]
                name = str(function.get("name", ""))
                keys.append(call_key(namespace, anchor, ordinal, position, name, function.get("arguments", "")))
    return keys
