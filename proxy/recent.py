"""The proxy's bounded memories, all of them cachetools' caches, used one way.

A memory that forgets its least recently used entries is a :class:`cachetools.LRUCache`: writing
an entry is a use, and so is reading it with ``cache[key]`` or ``cache.get``. A memory whose order
is the order entries were last *written* reads them with :func:`peek`, which is no use. Entries
that expire are in a :class:`cachetools.TTLCache` (one lifetime) or :class:`cachetools.TLRUCache`
(each its own); entries written once and never refreshed, in a :class:`cachetools.FIFOCache`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from cachetools import Cache, LRUCache

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
        self._members: LRUCache[T, None] = LRUCache(max_entries)

    def __contains__(self, item: object) -> bool:
        return item in self._members

    def __len__(self) -> int:
        return len(self._members)

    def add(self, item: T) -> bool:
        """Add or refresh ``item``; True when it was already a member."""
        present = item in self._members
        self._members[item] = None
        return present

    def touch(self, item: T) -> bool:
        """Refresh ``item`` if it is a member; True when it is."""
        if item not in self._members:
            return False
        self._members[item] = None
        return True

    def discard(self, item: T) -> None:
        self._members.pop(item, None)


class LastWritten(Generic[K, V]):
    """A memory of at most ``max_entries`` that forgets the entry written longest ago, read without
    counting a use (as :func:`peek` reads a cache), kept in an :class:`~collections.OrderedDict`: its
    writes run in C, for a memory written once per message of a history on every request (a
    :class:`cachetools.LRUCache` write is a few Python calls)."""

    def __init__(self, max_entries: int) -> None:
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._max = max(1, max_entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def write(self, keys: Iterable[K], value: V) -> None:
        """Write ``value`` under every key: each becomes the most recently written."""
        entries = self._entries
        for key in keys:
            entries[key] = value
            entries.move_to_end(key)
        while len(entries) > self._max:
            entries.popitem(last=False)
