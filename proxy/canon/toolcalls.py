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

A call the conversation's last request sent too keeps what was decided for it then: those bytes
went upstream, so the same history is forwarded the same way again (a call remembered since, by
another conversation that asked the same thing, does not rewrite a history already forwarded),
and a request looks up only the calls it adds.
"""

from __future__ import annotations

import json
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import methodcaller
from typing import Any

import xxhash
from cachetools import LRUCache

from proxy.canon.actions import Action
from proxy.canon.layout import extend
from proxy.openai import (
    ARGUMENTS_MEMO_CHARS,
    Continuations,
    canonical_arguments,
    extend_links,
    memo_by_text,
    message_text,
)
from proxy.recent import peek


@dataclass(frozen=True, slots=True)
class GeneratedCall:
    id: str
    arguments: str


class ToolCallMemory:
    """Bounded LRU of tool calls the backend generated, by position key and, per tenant, by their
    own id (that one forgets the least recently remembered: looking a call up by id is no use).

    An id is the client's to choose: only a call the backend generated is found by its id, only in
    the tenant it was generated for, and only to restore the form of the very arguments the client
    re-sends (``_restore``), never their values."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self._entries: LRUCache[int, GeneratedCall] = LRUCache(max_entries)
        self._by_id: LRUCache[tuple[str, str], GeneratedCall] = LRUCache(max_entries)
        # Per tenant and conversation, what was decided for the last request's calls (and the
        # anchors of its messages): the next request looks up only the calls it adds.
        self.anchored: Continuations[Restored] = Continuations()
        # Per tenant and conversation, the messages after the leading system ones and the first of
        # them that holds calls (-1: none): a history without calls is not looked through again
        # (a Dify app's clock changes its system prompt, and so the list, on every request).
        self.called: Continuations[int] = Continuations()

    def remember(self, key: int, call: GeneratedCall, generated_for: str | None = None) -> None:
        """Remember ``call`` under ``key``; ``generated_for``: the namespace (tenant) the backend
        generated it for, which finds it by its id too (a call a client sent is found by key only)."""
        self._entries[key] = call
        if generated_for is not None:
            self._by_id[(generated_for, call.id)] = call

    def recall(self, key: int) -> GeneratedCall | None:
        return self._entries.get(key)

    def by_id(self, namespace: str, call_id: Any) -> GeneratedCall | None:
        """The call the backend generated with this id for ``namespace``, when the client kept the
        original id."""
        return peek(self._by_id, (namespace, call_id)) if isinstance(call_id, str) else None

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

    anchors: array[int]
    histories: array[int]


def anchors_of(messages: list[dict[str, Any]], resumed: Anchors | None = None, shared: int = 0) -> Anchors:
    """The :class:`Anchors` of ``messages``; ``resumed``: those of a list whose first ``shared``
    messages equal these (:mod:`proxy.openai.continuation`). Arrays: a slice is a copy of memory,
    and the collector has nothing to walk."""
    if resumed is None:
        shared = 0
    anchors = resumed.anchors[:shared] if resumed is not None else array("Q")
    anchors.extend(map(_anchor, messages[shared:]))
    histories = resumed.histories[: shared + 1] if resumed is not None else array("Q", [0])
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


# What a call of the history became: the id forwarded, and the arguments where they were restored
# (``_KEPT``: the client's own).
_KEPT: Any = object()
Edit = tuple[Any, Any] | None


@dataclass(frozen=True, slots=True)
class Restored:
    """What :func:`restore_tool_calls` decided for a message list, in a form a request that re-sends
    the list's first ``s`` messages takes up as it stood after them: per message boundary ``i``
    (lists of ``len + 1``), the position the next assistant message has (the anchor of the last
    user message before ``i`` and the assistant messages since) and the calls before ``i``; per
    call, in order, its position key, the id forwarded, the rename and the restorations; per
    message whose calls changed, each call's edit (re-applied to the request's own message)."""

    anchors: Anchors
    user_anchor: array[int]
    ordinal: array[int]
    calls: array[int]
    bases: array[int]
    ids: list[Any]
    renames: list[tuple[str, Any] | None]
    restored: array[int]  # ids restored among the first c calls (len calls + 1)
    arguments: array[int]  # arguments restored among the first c calls
    edits: dict[int, tuple[Edit, ...]]
    # (message index, tool_call_id) of each tool message with a string id, and how many before ``i``.
    tool_ids: list[tuple[int, str]]
    tools: array[int]


def restore_tool_calls(messages: list[dict[str, Any]], namespace: str, memory: ToolCallMemory | None) -> list[Action]:
    """Rewrite history tool calls (``messages`` must be a list the caller owns: a message that
    changes is replaced by a new one, never changed in place).

    The calls of the messages a conversation's last request sent too keep what was decided for
    them then (:class:`Restored`, in ``memory.anchored``): those bytes went upstream, and only the
    calls the request adds are looked up."""
    if not (_has_calls(messages) if memory is None else _holds_calls(messages, namespace, memory)):
        return []
    if memory is None:
        return _restore(messages, namespace, None, anchors_of(messages), None, 0)[0]
    resumed = memory.anchored.resume(namespace, messages)
    previous = resumed.state
    shared = resumed.shared if previous is not None else 0
    anchors = anchors_of(messages, previous.anchors if previous is not None else None, shared)
    original = list(messages)
    actions, state = _restore(messages, namespace, memory, anchors, previous, shared)
    resumed.keep(original, state)
    return actions


def _has_calls(messages: list[dict[str, Any]]) -> bool:
    """Whether an assistant message holds tool calls (one pass in C over a validated list)."""
    try:
        if not any(map(_GET_CALLS, messages)):
            return False
    except (AttributeError, TypeError):
        pass  # not every message is an object: the general look below
    return any(message.get("tool_calls") for message in messages if message.get("role") == "assistant")


_GET_CALLS = methodcaller("get", "tool_calls")


def _holds_calls(messages: list[dict[str, Any]], namespace: str, memory: ToolCallMemory) -> bool:
    """:func:`_has_calls`, looking only at the messages the conversation's last request did not send
    (its leading system messages hold none: they are not assistant messages)."""
    start = 0
    while start < len(messages) and isinstance(messages[start], dict) and messages[start].get("role") == "system":
        start += 1
    history = messages[start:]
    resumed = memory.called.resume(namespace, history)
    first, shared = resumed.state, resumed.shared
    if first is None or first >= shared:
        found = [offset for offset in range(shared, len(history)) if _calls_in(history[offset])]
        first = found[0] if found else -1
    resumed.keep(history, first)
    return first >= 0


def _calls_in(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant" and bool(message.get("tool_calls"))


def _restore(
    messages: list[dict[str, Any]],
    namespace: str,
    memory: ToolCallMemory | None,
    known: Anchors,
    previous: Restored | None,
    shared: int,
) -> tuple[list[Action], Restored]:
    histories = known.histories
    if previous is not None and shared:
        calls_before = previous.calls[shared]
        user_anchor, ordinal = previous.user_anchor[: shared + 1], previous.ordinal[: shared + 1]
        calls, bases = previous.calls[: shared + 1], previous.bases[:calls_before]
        ids, renames = previous.ids[:calls_before], previous.renames[:calls_before]
        restored_at, arguments_at = previous.restored[: calls_before + 1], previous.arguments[: calls_before + 1]
        tool_ids = previous.tool_ids[: previous.tools[shared]]
        tools = previous.tools[: shared + 1]
        edits = {index: kept for index, kept in previous.edits.items() if index < shared}
        for index, kept in edits.items():
            messages[index] = _edited(messages[index], kept)
    else:
        shared = 0
        user_anchor, ordinal, calls, tools = array("Q", [0]), array("Q", [0]), array("Q", [0]), array("Q", [0])
        bases, restored_at, arguments_at = array("Q"), array("Q", [0]), array("Q", [0])
        ids, renames, tool_ids = [], [], []
        edits = {}
    earlier = _EarlierCalls(bases, ids, len(messages) - shared)
    anchor, position_ordinal = user_anchor[-1], ordinal[-1]
    restored, arguments_restored = restored_at[-1], arguments_at[-1]
    for index in range(shared, len(messages)):
        message = messages[index]
        role = message.get("role")
        if role == "user":
            anchor, position_ordinal = known.anchors[index], 0
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if isinstance(call_id, str):
                tool_ids.append((index, call_id))
        elif role == "assistant":
            message_calls = message.get("tool_calls")
            if isinstance(message_calls, list) and message_calls:
                changes: list[Edit] = []
                for number, call in enumerate(message_calls):
                    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
                        changes.append(None)
                        continue
                    function = call["function"]
                    name = str(function.get("name", ""))
                    base = call_key(namespace, anchor, position_ordinal, number, name, function.get("arguments", ""))
                    key = nth_key(base, earlier.occurrences(base))
                    old_id = call.get("id")
                    # A client that kept the backend's own id identifies the call exactly; the
                    # position key can collide between conversations that happen to ask the same
                    # thing (harmless for calls the backend generated: a client re-sending them
                    # with fresh ids has no ids of its own). Calls the proxy did not relay are
                    # remembered under the whole history before them (``forwarded_key``): restored
                    # only within the same conversation, never into another that happens to ask the
                    # same thing (a client's own ids must stay its own).
                    original = (
                        (
                            _same_call(memory.by_id(namespace, old_id), function.get("arguments", ""))
                            or memory.recall(key)
                            or memory.recall(extend(histories[index], key))
                        )
                        if memory is not None
                        else None
                    )
                    if original is not None and earlier.used(original.id):
                        original = None  # never two calls with one id in a request
                    new_id: Any = old_id
                    new_arguments: Any = _KEPT
                    if original is not None:
                        new_id = original.id
                        if _renders_differently(original.arguments, function.get("arguments")):
                            new_arguments = original.arguments
                            arguments_restored += 1
                        if new_id != old_id:
                            restored += 1
                    else:
                        arguments = function.get("arguments")
                        if memory is not None and isinstance(old_id, str) and isinstance(arguments, str):
                            memory.remember(
                                extend(histories[index], key), GeneratedCall(id=old_id, arguments=arguments)
                            )
                    renames.append((old_id, new_id) if isinstance(old_id, str) and old_id != new_id else None)
                    earlier.add(base, new_id)
                    restored_at.append(restored)
                    arguments_at.append(arguments_restored)
                    changed = new_id != old_id or new_arguments is not _KEPT
                    changes.append((new_id, new_arguments) if changed else None)
                if any(change is not None for change in changes):
                    edits[index] = tuple(changes)
                    messages[index] = _edited(message, edits[index])
            position_ordinal += 1
        user_anchor.append(anchor)
        ordinal.append(position_ordinal)
        calls.append(len(bases))
        tools.append(len(tool_ids))
    # A call is renamed only where its id was restored (``restored`` counts them, earlier requests' too).
    renamed = dict(filter(None, renames)) if restored else {}
    if renamed:
        for index, call_id in tool_ids:
            if call_id in renamed:
                messages[index] = {**messages[index], "tool_call_id": renamed[call_id]}
    actions = []
    if restored:
        actions.append(Action("tool_call_ids_restored", str(restored)))
    if arguments_restored:
        actions.append(Action("tool_call_arguments_restored", str(arguments_restored)))
    state = Restored(
        known, user_anchor, ordinal, calls, bases, ids, renames, restored_at, arguments_at, edits, tool_ids, tools
    )
    return actions, state


class _EarlierCalls:
    """The calls before the one being restored (``bases``, ``ids``: those the request shares with its
    conversation's last, then each added in turn): how often a key's base occurred, and whether an id
    is taken. A request that adds a few messages asks a scan in C of each (its work then grows with
    what is new, not with a thousand earlier calls); one that adds many counts them all once."""

    __slots__ = ("_bases", "_counts", "_ids", "_used")

    # Messages a request adds past which the earlier calls are counted at once.
    SCANNED_MAX = 32

    def __init__(self, bases: array[int], ids: list[Any], added: int) -> None:
        self._bases, self._ids = bases, ids
        self._counts: Counter[int] | None = None
        self._used: set[Any] | None = None
        if added > self.SCANNED_MAX:
            self._counts = Counter(bases)
            self._used = set(compress(ids, map(isinstance, ids, repeat(str))))

    def occurrences(self, base: int) -> int:
        return self._counts[base] if self._counts is not None else self._bases.count(base)

    def used(self, call_id: str) -> bool:
        return call_id in self._used if self._used is not None else call_id in self._ids

    def add(self, base: int, call_id: Any) -> None:
        self._bases.append(base)
        self._ids.append(call_id)
        if self._counts is not None:
            self._counts[base] += 1
        if self._used is not None and isinstance(call_id, str):
            self._used.add(call_id)


def _same_call(found: GeneratedCall | None, sent: Any) -> GeneratedCall | None:
    """``found`` where its arguments are the ones the client re-sends, in another form at most
    (canonically equal: what the position key holds too): a restoration changes how arguments are
    written, never what they say, whatever id a client puts on a call."""
    if found is None or canonical_arguments(found.arguments) != canonical_arguments(sent):
        return None
    return found


def _renders_differently(generated: str, sent: Any) -> bool:
    """Whether the client's arguments reach the prompt otherwise than the bytes the backend
    generated. The engine parses a call's argument string before the chat template renders it
    (vLLM's ``_postprocess_messages``; the templates then ``tojson`` the value, keys in their
    order): spacing and escapes are not rendered, key order and values are. Restoring bytes that
    render the same would rewrite the client's request for nothing."""
    if generated == sent:
        return False
    if not isinstance(sent, str):
        return True
    return _rendered(generated) != _rendered(sent)


@memo_by_text(ARGUMENTS_MEMO_CHARS)
def _rendered(arguments: str) -> str | None:
    # History re-sends the same argument strings on every turn: each is parsed once. None: not JSON
    # (the engine cannot render it as the generated call).
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        return None


def _edited(message: dict[str, Any], edit: tuple[Edit, ...]) -> dict[str, Any]:
    """``message`` with its calls' ids and arguments as ``edit`` says (None: the call as sent)."""
    calls = []
    for call, change in zip(message["tool_calls"], edit, strict=True):
        if change is not None:
            new_id, arguments = change
            call = {**call}
            if arguments is not _KEPT:
                call["function"] = {**call["function"], "arguments": arguments}
            if new_id != call.get("id"):
                call["id"] = new_id
        calls.append(call)
    return {**message, "tool_calls": calls}


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
        memory.remember(nth_key(base, earlier[base]), GeneratedCall(id=call_id, arguments=arguments), namespace)


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
