"""Which forwarded chat message stands for which message of the view it was made from.

The chat pipeline (canonicalization, summary anchoring) copies messages, so identity is lost;
what it does to a conversation is known, though: messages are rewritten in place (volatile
lines moved out of a system prompt, tool-call ids restored), system messages are inserted
(moved lines, a summary) or removed (a system prompt left empty), a run of old turns is
removed (folded into a summary) and, for repaired windows, messages are inserted. A diff of
the two message lists recovers that: equal runs are unchanged messages, and inside a replaced
run messages pair up in order by role (a rewrite never changes a role).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from itertools import compress, islice
from itertools import count as count_from
from operator import is_not
from typing import Any

import xxhash

from proxy.openai import dumps


@dataclass(frozen=True, slots=True)
class Aligned:
    """One forwarded message: the view message it stands for (None: inserted), and whether it
    differs from it."""

    view: int | None
    changed: bool


def digest(message: Any) -> int:
    return xxhash.xxh3_64_intdigest(dumps(message))


def align(view: Sequence[Any], forwarded: Sequence[Any]) -> list[Aligned]:
    # Most of a conversation is forwarded as it came, and the pipeline's copies share their values
    # with the view's messages (equal at the cost of an identity check each): the equal runs at both
    # ends are matched without serializing a message, and only what lies between is aligned.
    head = common_head(view, forwarded)
    tail = common_head(view[head:][::-1], forwarded[head:][::-1])
    out = [Aligned(i, False) for i in range(head)]
    middle = _anchored(view[head : len(view) - tail], forwarded[head : len(forwarded) - tail])
    out.extend(Aligned(None if m.view is None else head + m.view, m.changed) for m in middle)
    out.extend(Aligned(len(view) - tail + k, False) for k in range(tail))
    return out


def _anchored(view: Sequence[Any], forwarded: Sequence[Any]) -> list[Aligned]:
    """The alignment of what lies between the equal ends: anchors (a forwarded message that is a view
    message), in order, and only the runs between them diffed. A message the pipeline left alone is
    the view's very object (it copies only what it changes); where the messages came back as copies,
    a message whose serialization is unique in both lists is the anchor instead. A system prompt
    changed at the top and a block inserted near the end leave the whole history between them as
    anchors: linear in the conversation, where one diff of it all grew with its square (a 1,000-turn
    conversation on /v1/messages: 30 ms a request)."""
    if len(view) < ANCHOR_MIN or len(forwarded) < ANCHOR_MIN:
        return _diff(view, forwarded)
    # Both lists are alive: an id names one object of either.
    where = {id(message): index for index, message in enumerate(view)}
    anchors = [where.get(id(message), -1) for message in forwarded]
    if 2 * sum(index >= 0 for index in anchors) < len(forwarded):
        anchors = _unique_digest_anchors(view, forwarded)
    out: list[Aligned] = []
    done_view = done_forwarded = 0  # the runs before these are aligned
    for position, index in enumerate(anchors):
        if index < done_view:
            continue  # no anchor, or one out of order: inside a run that is diffed
        if done_forwarded < position:
            # (View messages with nothing forwarded between, folded into a summary, stand for nothing.)
            gap = _diff(view[done_view:index], forwarded[done_forwarded:position])
            out.extend(Aligned(None if m.view is None else done_view + m.view, m.changed) for m in gap)
        out.append(Aligned(index, False))
        done_view, done_forwarded = index + 1, position + 1
    gap = _diff(view[done_view:], forwarded[done_forwarded:])
    out.extend(Aligned(None if m.view is None else done_view + m.view, m.changed) for m in gap)
    return out


def _unique_digest_anchors(view: Sequence[Any], forwarded: Sequence[Any]) -> list[int]:
    """For each forwarded message, the view message with the same serialization where that is found
    once in each list (-1 otherwise)."""
    a = [digest(m) for m in view]
    b = [digest(m) for m in forwarded]
    once_a = _once(a)
    once_b = _once(b)
    return [once_a.get(d, -1) if d in once_b else -1 for d in b]


def _once(digests: list[int]) -> dict[int, int]:
    seen: dict[int, int] = {}
    repeated: set[int] = set()
    for index, value in enumerate(digests):
        if value in seen:
            repeated.add(value)
        seen[value] = index
    return {value: index for value, index in seen.items() if value not in repeated}


# Below this many messages between the equal ends, a diff costs less than the anchors' lookup.
ANCHOR_MIN = 16


def unchanged_lead(view: Sequence[Any], forwarded: Sequence[Any], system_first: bool) -> int:
    """How many leading messages the two lists hold unchanged; where the view opens with the client's
    system prompt (``system_first``) and that alone changed (lines moved out of it), counted past it."""
    head = common_head(view, forwarded)
    if not head and system_first and forwarded and _role(forwarded[0]) == "system":
        head = 1 + common_head(view[1:], forwarded[1:])
    return head


def same_message(a: Any, b: Any) -> bool:
    """The same message: the very object, or equal (as :func:`common_head` compares them)."""
    return a is b or (type(a) is type(b) and a == b)


def common_head(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading messages of the two lists are the same message (the very object, or equal).
    Runs of the very objects (most of a history: the view's messages are the forwarded ones) are
    passed in C; only a message that is another object is compared by value."""
    end = min(len(a), len(b))
    count = 0
    while count < end:
        count = next(compress(count_from(count), map(is_not, islice(a, count, end), islice(b, count, end))), end)
        if count == end:
            break
        x, y = a[count], b[count]
        # Equal as values: the same message (the pipeline changes text, never a key's order or a number's type).
        if not (type(x) is type(y) and x == y):
            break
        count += 1
    return count


def _diff(view: Sequence[Any], forwarded: Sequence[Any]) -> list[Aligned]:
    out: list[Aligned] = [Aligned(None, True)] * len(forwarded)
    if not forwarded:
        return out
    a = [digest(m) for m in view]
    b = [digest(m) for m in forwarded]
    if a == b:
        return [Aligned(i, False) for i in range(len(b))]
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            for k in range(j2 - j1):
                out[j1 + k] = Aligned(i1 + k, False)
        elif tag == "replace":
            i = i1
            for j in range(j1, j2):
                role = _role(forwarded[j])
                k = i
                while k < i2 and _role(view[k]) != role:
                    k += 1
                if k < i2:
                    out[j] = Aligned(k, a[k] != b[j])
                    i = k + 1
    return out


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None
