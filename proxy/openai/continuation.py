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
not text, and a fixed share for each message's objects) and forgets the conversations used least
recently first: ``DEFAULT_MAX_CHARS`` each (the lists of a few hundred agent conversations). The
texts themselves are the request's: the memories of one request's lists share them.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import islice
from operator import is_
from typing import Any, Generic, TypeVar

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


class _KeptList(list[Any]):
    """The messages of a list kept: a copy of the request's, never changed."""

    __slots__ = ()


# The lists kept last: parts of one request keep the same messages (a list and another made from
# it), and one copy serves them all.
_RECENT: deque[_KeptList] = deque(maxlen=4)


def _kept_list(messages: Sequence[Any]) -> _KeptList:
    """A kept copy of ``messages``: one made lately of the same objects, else a new one."""
    if messages:
        first, last = messages[0], messages[-1]
        for recent in _RECENT:
            # The ends first: a comparison of lists with other objects would look inside them.
            if len(recent) == len(messages) and recent[0] is first and recent[-1] is last and recent == messages:
                return recent
    made = _KeptList(messages)
    _RECENT.append(made)
    return made


@dataclass(slots=True)
class _Kept:
    """One message list, and what parts derived from it (``states``, by part, filled in as each
    keeps its own). ``ends`` and ``chars``: the rough size of ``messages[:ends[k]]`` is
    ``chars[k]`` (what the memory counts), at the boundaries of the runs of messages added at
    once (the first request's whole list, then what each next one added). ``base``: the list this
    one continued, equal in its first ``base_shared`` messages, with what the parts that have not
    kept theirs here yet derived from it (one level: a list that becomes a base gives up its own)."""

    messages: list[Any]
    ends: list[int]
    chars: list[int]
    states: dict[str, Any]
    base: _Kept | None = None
    base_shared: int = 0

    @property
    def total(self) -> int:
        return self.chars[-1]

    def prefix(self, count: int) -> tuple[list[int], list[int]]:
        """``ends`` and ``chars`` of ``messages[:count]`` (within a run, that run's first messages
        sized again: a few)."""
        at = bisect_right(self.ends, count) - 1
        ends, chars = self.ends[: at + 1], self.chars[: at + 1]
        if ends[-1] < count:
            chars.append(chars[-1] + _rough_size(self.messages[ends[-1] : count]))
            ends.append(count)
        return ends, chars


class Resumption(Generic[State]):
    """One request's look into the memory for one part: ``shared`` leading messages equal those of
    the list ``state`` was derived from (0 and None: nothing to resume). :meth:`keep` records the
    request's list and the part's state for the next request of the conversation."""

    __slots__ = ("_from", "_kept", "_key", "_matched", "_memory", "_messages", "_part", "shared", "state")

    def __init__(
        self,
        memory: Continuations[State],
        key: Hashable,
        part: str,
        kept: _Kept | None = None,
        matched: int = 0,
        messages: Sequence[Any] = (),
    ) -> None:
        self._memory, self._key, self._part, self._kept, self._matched = memory, key, part, kept, matched
        self._messages = messages
        self._from: Sequence[Any] = ()  # the list ``state`` was derived from
        self.shared, self.state = 0, None
        if kept is None or not matched:
            return
        if part in kept.states:
            self.shared, self.state, self._from = matched, kept.states[part], kept.messages
        elif kept.base is not None and part in kept.base.states and kept.base_shared:
            # Another part read this very list first in this request: this part resumes from the
            # list before it, as far as the two agree.
            self.shared, self.state = min(matched, kept.base_shared), kept.base.states[part]
            self._from = kept.base.messages

    def identical(self) -> int:
        """How many of the ``shared`` leading messages are the very objects ``state`` was derived from:
        what a part may take where it passes on values, not digests (an object equal by ``==`` may
        differ as JSON: ``1`` for ``true``, keys in another order). A long body's history comes back
        from the resumed parse (:mod:`proxy.openai.resumedjson`) as those objects."""
        return identical_prefix(self._from, self._messages, self.shared) if self.shared else 0

    def keep(self, messages: Sequence[Any], state: State) -> None:
        if self._key is None:
            return  # too short to keep (``MIN_MESSAGES``)
        self._memory._keep(self._key, self._part, self._kept, self._matched, messages, state)


class Continuations(Generic[State]):
    """The memory of the last message lists read per conversation and scope (a tenant: no
    conversation resumes from another tenant's), with what each part derived from them; bounded
    by ``max_chars``. Parts that read the same list in a request share one memory: the first
    compares it with the conversation's last one, the others find it equal to what the first kept."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        # Least recently used first; each entry's size (``_chars_of``) kept beside it. An
        # OrderedDict, not a cachetools LRUCache: it is read and written several times a request,
        # and a sized LRUCache write is a few Python calls and a size computed again.
        self._kept: OrderedDict[Hashable, tuple[_Kept, ...]] = OrderedDict()
        self._sizes: dict[Hashable, int] = {}
        self._chars = 0
        self._max_chars = max(1, max_chars)
        # What a list too short to keep finds (nothing; keeping it keeps nothing): one for all.
        self._short: Resumption[State] = Resumption(self, None, "")

    def resume(self, scope: Hashable, messages: Sequence[Any], part: str = "") -> Resumption[State]:
        if len(messages) < MIN_MESSAGES:
            return self._short
        key = (scope, _opening(messages))
        best: _Kept | None = None
        matched = 0
        for kept in self._used(key):
            if len(kept.messages) <= matched:
                continue  # it cannot share more than the one found: not compared (a whole history by value)
            count = shared_prefix(kept.messages, messages)
            if count > matched:
                best, matched = kept, count
            if count == len(kept.messages):
                break  # the list continues this one whole: the most a candidate can give
        return Resumption(self, key, part, best, matched, messages)

    def __len__(self) -> int:
        return len(self._kept)

    def _keep(
        self,
        key: Hashable,
        part: str,
        previous: _Kept | None,
        matched: int,
        messages: Sequence[Any],
        state: State,
    ) -> None:
        if previous is not None and matched == len(previous.messages) == len(messages):
            previous.states[part] = state  # the same list: one more part's state on it
            if key in self._kept:
                self._kept.move_to_end(key)  # used most recently
            else:
                self._put(key, (previous,))
            return
        matched = min(matched, len(messages))  # a part may keep less than it read
        ends, chars = previous.prefix(matched) if previous is not None and matched else ([0], [0])
        if ends[-1] < len(messages):
            chars.append(chars[-1] + _rough_size(messages[ends[-1] :]))
            ends.append(len(messages))
        if chars[-1] + 1 > self._max_chars:
            return  # larger than the whole memory: nothing to keep it for
        base = previous if previous is not None and matched else None
        if base is not None:
            base.base = None  # one level
        kept = _Kept(_kept_list(messages), ends, chars, {part: state}, base, matched if base is not None else 0)
        # The list this one continues whole is replaced (it stays as the base); one it forked
        # from stays a candidate (a conversation that opened the same way, or the branch a
        # regenerated reply left).
        extended = previous if previous is not None and matched == len(previous.messages) else None
        others = tuple(k for k in self._kept.get(key, ()) if k is not extended)
        self._put(key, (kept, *others[: CANDIDATES - 1]))

    def _used(self, key: Hashable) -> tuple[_Kept, ...]:
        found = self._kept.get(key)
        if found is None:
            return ()
        self._kept.move_to_end(key)
        return found

    def _put(self, key: Hashable, value: tuple[_Kept, ...]) -> None:
        """Keep ``value`` under ``key`` as the most recently used; forget the least recently used
        past ``max_chars``."""
        kept, sizes = self._kept, self._sizes
        size = _chars_of(value)
        self._chars += size - sizes.get(key, 0)
        kept[key] = value
        kept.move_to_end(key)
        sizes[key] = size
        while self._chars > self._max_chars and kept:
            oldest, _ = kept.popitem(last=False)
            self._chars -= sizes.pop(oldest)


def shared_prefix(kept: Sequence[Any], messages: Sequence[Any]) -> int:
    """How many leading messages the two lists have equal (``==``), compared a slice at a time in
    C (list equality, which takes the same object for equal without looking inside it).

    Messages that are the same objects cost next to nothing: another part of the same request
    reading the same list, or a list made from it with a message or two changed. So do messages
    that are the very objects of a prefix found equal by value lately (:data:`_EQUAL`): the last
    request's list as another memory kept it against this request's list as the first part
    compared it. What neither settles is compared by value: a request's history is read whole
    once, by the first part that compares it, and not again by the others."""
    n = min(len(kept), len(messages))
    at = 0
    valued = False
    while at < n:
        if kept[at] is messages[at]:
            at += _agreeing(kept, at, messages, at, n - at)
            if at < n and kept[at] != messages[at]:
                break
            continue
        through = _through_equal(kept, messages, at, n)
        if through > at:
            at = through
            continue
        valued = True
        if kept[at] != messages[at]:
            break
        at += 1  # one message equal by value (a system prompt made again): the rest may be known
        if at < n and kept[at] is not messages[at] and _through_equal(kept, messages, at, n) == at:
            # Two in a row that only their values tell apart: the rest by value.
            at += _agreeing(kept, at, messages, at, n - at)
            break
    if valued and at:
        # What is kept (``_Kept.messages``) is never changed: held as it is; the other, copied.
        _EQUAL.append((kept if type(kept) is _KeptList else list(kept[:at]), list(messages[:at])))
    return at


# Prefixes found equal lately, each as the two lists' messages (copies, or a kept list, which is
# never changed: a list changed later changes nothing here; lists, as what they are compared
# with), the second as long as the prefix: a message at an index of one equals the message at that
# index in the other. Objects are not changed in place to other values
# on the way (the proxy's steps copy a message before they change it), and each entry holds its
# messages, so no id is reused.
_EQUAL: deque[tuple[list[Any], list[Any]]] = deque(maxlen=4)


def identical_prefix(a: Sequence[Any], b: Sequence[Any], limit: int | None = None) -> int:
    """How many leading items of ``a`` and ``b`` (at most ``limit``) are the very same objects: one
    pass in C (``operator.is_`` mapped over both)."""
    count = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    same = list(map(is_, islice(a, count), islice(b, count)))
    try:
        return same.index(False)
    except ValueError:
        return count


def shared_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items two sequences (lists, arrays, tuples, strings) have equal: slices
    compared in C (equal most of the way, as a conversation's prompts are: one comparison), halving
    the rest."""
    count = min(len(a), len(b))
    if a[:count] == b[:count]:
        return count
    low, high = 0, count  # a[:low] == b[:low]; a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


def _agreeing(a: Sequence[Any], a_start: int, b: Sequence[Any], b_start: int, length: int) -> int:
    """How many items from ``a[a_start]`` and ``b[b_start]`` on (at most ``length``) are equal: one
    slice comparison where all are, else halving the rest (each slice compared in C, the same
    objects without a look inside)."""
    if _run(a, a_start, length) == _run(b, b_start, length):
        return length
    low, high = 0, length  # equal before low; not all equal before high
    while high - low > 1:
        middle = (low + high) // 2
        if a[a_start + low : a_start + middle] == b[b_start + low : b_start + middle]:
            low = middle
        else:
            high = middle
    return low


def _run(items: Sequence[Any], start: int, length: int) -> Sequence[Any]:
    """``items[start : start + length]``, or ``items`` itself where that is all of it: list
    equality compares the same objects without touching them, a slice takes a reference to each
    (a kept list's messages are long out of the processor's cache)."""
    return items if start == 0 and length == len(items) else items[start : start + length]


def _through_equal(kept: Sequence[Any], messages: Sequence[Any], at: int, n: int) -> int:
    """How far from ``at`` both lists hold, side by side, the messages of a prefix found equal
    lately (``at``: not there). The prefix's index may be a few places off ours: a list without
    its leading system messages against a whole one, a block of lines inserted."""
    # The most recent first (``new``: as long as the prefix); a copy of the few entries, as another
    # thread's proxy (tests run several apps in one process) may append meanwhile.
    entries = tuple(reversed(_EQUAL))
    # A prefix at the same index first: there the runs compared are often whole lists (the same
    # kept list, a list as long as the prefix), which are compared without touching a message; a
    # slice takes a reference to each (a kept list's messages are long out of cache).
    aligned = [
        (old, new, at) for old, new in entries if at < len(new) and old[at] is kept[at] and new[at] is messages[at]
    ]
    for old, new, where in aligned or ((old, new, _near(old, kept[at], at, len(new))) for old, new in entries):
        if where < 0 or new[where] is not messages[at]:
            continue
        length = min(n - at, len(new) - where)
        held = min(_agreeing(kept, at, old, where, length), _agreeing(messages, at, new, where, length))
        if held:
            return at + held
    return at


# How far from its own index a message is looked for in a prefix found equal.
NEAR = 8


def _near(items: Sequence[Any], item: Any, at: int, end: int) -> int:
    """Where ``item`` itself is in ``items[:end]``, within ``NEAR`` places of ``at``; -1 where not."""
    for where in range(max(0, at - NEAR), min(end, at + NEAR + 1)):
        if items[where] is item:
            return where
    return -1


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


# What a kept message costs beyond its characters (a dict, its keys, a list slot), counted as
# characters: many short messages weigh what their objects weigh.
MESSAGE_OVERHEAD = 256


def _rough_size(messages: Sequence[Any]) -> int:
    """About how much messages hold: their JSON (one serialization in C), and their objects."""
    try:
        return len(dumps(list(messages))) + MESSAGE_OVERHEAD * len(messages)
    except (TypeError, ValueError):
        return sum(map(_rough_chars, messages))


def _rough_chars(message: Any) -> int:
    """About how much a message holds: the JSON of it, and its objects."""
    try:
        return len(dumps(message)) + MESSAGE_OVERHEAD
    except (TypeError, ValueError):
        return 4 * MESSAGE_OVERHEAD


def _chars_of(kept: tuple[_Kept, ...]) -> int:
    # A list that became a base is counted with the list that continued it.
    return sum(k.total + (k.base.total if k.base is not None else 0) for k in kept) + 1
