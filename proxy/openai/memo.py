"""A memo of a function of one string, bounded by the characters it holds.

Tool calls' argument strings come back in every request of a conversation (the history re-sends
them), so what is read from one (its canonical form, its rendering) is kept rather than parsed
again. ``functools.lru_cache`` bounds such a memo by its number of entries, which says nothing of
its memory when a client decides how long the strings are (an agent writing files sends arguments
of tens of kilobytes): this one bounds the characters of what it keeps, least recently used out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")

# What an entry costs beyond its strings (the entry, its tuple, its size), in characters.
ENTRY_OVERHEAD = 160
# The characters each tool-call argument memo keeps (its argument strings and their forms).
ARGUMENTS_MEMO_CHARS = 16 * 1024 * 1024


class TextMemo(Generic[V]):
    """``function(text)`` kept per text; ``held``: the characters kept (text and a string result)."""

    def __init__(self, function: Callable[[str], V], max_chars: int) -> None:
        self._function = function
        self._max = max_chars
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self.held = 0

    def __call__(self, text: str) -> V:
        found = self._entries.get(text)
        if found is not None:
            self._entries.move_to_end(text)
            return found[0]
        value = self._function(text)
        size = len(text) + ENTRY_OVERHEAD
        if isinstance(value, str | bytes) and value is not text:
            size += len(value)
        if size <= self._max:
            self._entries[text] = (value, size)
            self.held += size
            while self.held > self._max:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.held -= dropped
        return value

    def cache_clear(self) -> None:
        self._entries.clear()
        self.held = 0


def memo_by_text(max_chars: int) -> Callable[[Callable[[str], V]], TextMemo[V]]:
    """Keep ``function(text)`` for the texts it is called with, least recently used out once the
    kept strings (each text, and a result that is another string) pass ``max_chars`` characters."""

    def decorate(function: Callable[[str], V]) -> TextMemo[V]:
        return TextMemo(function, max_chars)

    return decorate
