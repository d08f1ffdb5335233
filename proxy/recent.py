"""A bounded set that forgets its least recently used members."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class RecentSet(Generic[T]):
    """At most ``max_entries`` members; adding one more drops the least recently used."""

    def __init__(self, max_entries: int) -> None:
        self._members: OrderedDict[T, None] = OrderedDict()
        self._max_entries = max_entries

    def __contains__(self, item: object) -> bool:
        return item in self._members

    def __len__(self) -> int:
        return len(self._members)

    def add(self, item: T) -> bool:
        """Add or refresh ``item``; True when it was already a member."""
        present = self.touch(item)
        if not present:
            self._members[item] = None
            if len(self._members) > self._max_entries:
                self._members.popitem(last=False)
        return present

    def touch(self, item: T) -> bool:
        """Refresh ``item`` if it is a member; True when it is."""
        if item not in self._members:
            return False
        self._members.move_to_end(item)
        return True

    def discard(self, item: T) -> None:
        self._members.pop(item, None)
