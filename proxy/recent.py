"""The proxy's bounded memories, cachetools' caches used one way, and three kept in C.

A memory that forgets its least recently used entries is a :class:`cachetools.LRUCache`: writing
an entry is a use, and so is reading it with ``cache[key]`` or ``cache.get``. A memory whose order
is the order entries were last *written* reads them with :func:`peek`, which is no use. Entries
that expire are in a :class:`cachetools.TTLCache` (one lifetime) or :class:`cachetools.TLRUCache`
(each its own); entries written once and never refreshed, in a :class:`cachetools.FIFOCache`.

The memories a request asks once per message of its history (a forwarded prompt's chain links,
the blocks inserted at a position), :class:`RecentSet`, :class:`RecentMap` and
:class:`LastWritten`, are the same policies over an :class:`~collections.OrderedDict`, whose
operations run in C: a cachetools read or write is two to four Python calls, and a Claude Code
request made about sixty of them (5% of its CPU in the proxy).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

from cachetools import Cache

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T", bound=Hashable)


def peek(cache: Cache[K, V], key: K) -> V | None:
    """``cache.get(key)`` without counting a use: the entry keeps its place in the eviction order
    (an entry that expired is not there)."""
    if key not in cache:
        return None
    # The plain mapping's read: no subclass bookkeeping (recency) runs.
    return Cache.__getitem__(cache, key)


class RecentSet(Generic[T]):
    """At most ``max_entries`` members; adding one more drops the least recently used."""

    def __init__(self, max_entries: int) -> None:
        self._members: OrderedDict[T, None] = OrderedDict()
        self._max = max(1, max_entries)

    def __contains__(self, item: object) -> bool:
        return item in self._members

    def __len__(self) -> int:
        return len(self._members)

    def add(self, item: T) -> bool:
        """Add or refresh ``item``; True when it was already a member."""
        members = self._members
        if item in members:
            members.move_to_end(item)
            return True
        members[item] = None
        if len(members) > self._max:
            members.popitem(last=False)
        return False

    def touch(self, item: T) -> bool:
        """Refresh ``item`` if it is a member; True when it is."""
        try:
            self._members.move_to_end(item)
        except KeyError:
            return False
        return True

    def discard(self, item: T) -> None:
        self._members.pop(item, None)


class _Ordered(Generic[K, V]):
    """At most ``max_entries`` entries in an OrderedDict, the first the next to go."""

    def __init__(self, max_entries: int) -> None:
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._max = max(1, max_entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, key: K) -> V | None:
        """The entry, its place in the order kept."""
        return self._entries.get(key)

    @property
    def holds(self) -> Callable[[object], bool]:
        """Whether a key has an entry, as a function that runs in C (``map`` over many keys)."""
        return self._entries.__contains__


class RecentMap(_Ordered[K, V]):
    """At most ``max_entries`` entries; writing one more drops the least recently used. Reading
    with :meth:`get` is a use; :meth:`peek` is not."""

    def get(self, key: K) -> V | None:
        entries = self._entries
        found = entries.get(key)
        if found is not None:
            entries.move_to_end(key)
        return found

    def __setitem__(self, key: K, value: V) -> None:
        entries = self._entries
        entries[key] = value
        entries.move_to_end(key)
        if len(entries) > self._max:
            entries.popitem(last=False)


class LastWritten(_Ordered[K, V]):
    """A memory of at most ``max_entries`` that forgets the entry written longest ago, read without
    counting a use (as :func:`peek` reads a cache), kept in an :class:`~collections.OrderedDict`: its
    writes run in C, for a memory written once per message of a history on every request (a
    :class:`cachetools.LRUCache` write is a few Python calls)."""

    get = _Ordered.peek

    def write(self, keys: Iterable[K], value: V) -> None:
        """Write ``value`` under every key: each becomes the most recently written."""
        entries = self._entries
        for key in keys:  # inline, not a call per key: once per message of a history
            entries[key] = value
            entries.move_to_end(key)
        while len(entries) > self._max:
            entries.popitem(last=False)
