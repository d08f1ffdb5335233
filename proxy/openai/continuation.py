"""Where a request stops repeating the last request of its conversation, for the parts that derive
something from every message (hashes, chains, sizes).

A conversation re-sends its whole history on every turn, and each part that reads every message
(the session's fingerprints, the miss explanation's digests, the budget's sizes) would otherwise
do its work again on all of it. Such a part keeps, per conversation, the message list it read
last and what it derived from it (:class:`Continuations`); the next request's leading messages
that equal those take their results from what was kept, and only the rest is worked out. Finding
them is one comparison of the two lists, in C (about 9 us for the 74 messages of a 20-turn agent
conversation, where any part's own work is about a microsecond a message); no call is made per
message of the shared prefix.

A conversation is found by its opening: the first message that is not a system message (its
role and the start of its text). Conversations that open alike share a place, which holds the
last few of them; the one that shares the most leading messages is taken.

Equality is Python's (``==``): it does not see key order, nor tell ``1``, ``1.0`` and ``true``
apart. A part resumes only what those cannot change, or what only a report reads (a digest):
hashes, sizes and verdicts, never text; the body sent upstream is always made from the request.

Bounded: the memory counts the characters of the messages it keeps (text, or the JSON of what is
not text) and forgets the conversations used least recently first.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from cachetools import LRUCache

from proxy.openai.jsonio import dumps
from proxy.openai.messages import STABLE_ROLES

State = TypeVar("State")

# Characters of a conversation's opening that name its place (with the opening's length).
OPENING_CHARS = 256
# Conversations kept per opening: two that open alike (a greeting, an agent's task template)
# both resume, without a scan of many.
CANDIDATES = 2
DEFAULT_MAX_CHARS = 16 << 20
# Shorter lists are worked out whole: a system prompt and a question (an app's one-shot request)
# have no history to resume, and looking one up would cost more than it could save.
MIN_MESSAGES = 4


@dataclass(slots=True, frozen=True)
class _Kept(Generic[State]):
    """One message list a part read, and what it derived from it. ``chars[i]``: the rough size of
    ``messages[:i]``, what the memory counts (carried over for a prefix, measured for the rest)."""

    messages: list[Any]
    chars: list[int]
    state: State


class Resumption(Generic[State]):
    """One request's look into a part's memory: ``shared`` leading messages equal those of the
    kept list ``state`` was derived from (0 and None: nothing to resume). :meth:`keep` records the
    request's own list and state for the next request of the conversation."""

    __slots__ = ("_kept", "_key", "_memory", "shared", "state")

    def __init__(self, memory: Continuations[State], key: Hashable, kept: _Kept[State] | None, shared: int) -> None:
        self._memory, self._key, self._kept = memory, key, kept
        self.shared = shared
        self.state: State | None = kept.state if kept is not None and shared else None

    def keep(self, messages: Sequence[Any], state: State) -> None:
        if self._key is None:
            return  # too short to keep (``MIN_MESSAGES``)
        self._memory._keep(self._key, self._kept if self.shared else None, self.shared, messages, state)


class Continuations(Generic[State]):
    """A part's memory of the last message list it read per conversation and scope (a tenant: no
    conversation resumes from another tenant's), bounded by ``max_chars``."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self._kept: LRUCache[Hashable, tuple[_Kept[State], ...]] = LRUCache(max_chars, getsizeof=_chars_of)

    def resume(self, scope: Hashable, messages: Sequence[Any]) -> Resumption[State]:
        if len(messages) < MIN_MESSAGES:
            return Resumption(self, None, None, 0)
        key = (scope, _opening(messages))
        best: _Kept[State] | None = None
        shared = 0
        for kept in self._kept.get(key, ()):
            count = shared_prefix(kept.messages, messages)
            if count > shared:
                best, shared = kept, count
        return Resumption(self, key, best, shared)

    def __len__(self) -> int:
        return len(self._kept)

    def _keep(
        self,
        key: Hashable,
        previous: _Kept[State] | None,
        shared: int,
        messages: Sequence[Any],
        state: State,
    ) -> None:
        shared = min(shared, len(messages))  # a part may keep less than it read
        chars = previous.chars[: shared + 1] if previous is not None else [0]
        total = chars[-1]
        for message in messages[shared:] if previous is not None else messages:
            total += _rough_chars(message)
            chars.append(total)
        kept = _Kept(list(messages), chars, state)
        if total + 1 > self._kept.maxsize:
            return  # larger than the whole memory: nothing to keep it for
        # The list this one continues whole is replaced; one it forked from stays (a conversation
        # that opened the same way, or the branch a regenerated reply left).
        extended = previous if previous is not None and shared == len(previous.messages) else None
        others = tuple(k for k in self._kept.get(key, ()) if k is not extended)
        self._kept[key] = (kept, *others[: CANDIDATES - 1])


def shared_prefix(kept: Sequence[Any], messages: Sequence[Any]) -> int:
    """How many leading messages the two lists have equal. The whole of the shorter first (a
    conversation that grew: one comparison), else message by message."""
    length = min(len(kept), len(messages))
    if kept[:length] == messages[:length]:
        return length
    for index in range(length):
        if kept[index] != messages[index]:
            return index
    return length


def _opening(messages: Sequence[Any]) -> Hashable:
    """Role and start of the first message that is not a system message (a system prompt may vary
    between turns, a Dify clock; what opens the conversation is re-sent as it was)."""
    # Anything may be here: a part can look before the request is validated.
    for message in messages:
        if not isinstance(message, dict):
            return None
        role = message.get("role")
        if not isinstance(role, str):
            return None
        if role in STABLE_ROLES:
            continue
        content = message.get("content")
        if isinstance(content, list) and content and isinstance(content[0], dict):
            content = content[0].get("text")
        if isinstance(content, str):
            return (role, len(content), content[:OPENING_CHARS])
        return (role, None)
    return None


def _rough_chars(message: Any) -> int:
    """About how many characters a message holds: its text, or the JSON of anything else."""
    if isinstance(message, dict):
        content = message.get("content")
        if isinstance(content, str) and "tool_calls" not in message:
            return len(content) + 16
    try:
        return len(dumps(message))
    except TypeError:
        return 1024


def _chars_of(kept: tuple[_Kept[Any], ...]) -> int:
    return sum(k.chars[-1] for k in kept) + 1
