"""The floor: per request, the tokens no arrangement of the prompt can avoid computing.

A request's floor is the tokens of its lines that no earlier request of its app carried (the
model's own replies count as seen: the backend generated, hence cached, them). Direct traffic runs
at several times its floor, the proxy closer to it; the gap is what is left to win, and where.

Per app, a bounded memory of line hashes (two generations: when the newer fills half the bound it
becomes the older and the older is dropped, so a line used again survives); a forgotten line counts
again, so the floor errs high, never low. A message seen whole before is not split into lines again
(an append-only conversation's history costs a hash per message). Blank lines count nothing; each
tool definition counts as one line (its JSON, keys in canonical order). Tokens are the local
estimate (``count``: the proxy's TokenCounter), only ever asked for a line not seen before.

Pure: no I/O, no clock; the caller serializes access (one event loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from proxy.observability.digests import content_text

# Roles whose text the model generated: seen (cached by the backend when it generated them).
GENERATED_ROLES = frozenset({"assistant"})


def text_hash(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


class SeenSet:
    """A bounded set of 64-bit hashes: two generations of at most ``max_entries // 2`` each."""

    __slots__ = ("_half", "_new", "_old")

    def __init__(self, max_entries: int) -> None:
        self._half = max(1, max_entries // 2)
        self._new: set[int] = set()
        self._old: set[int] = set()

    def __contains__(self, item: int) -> bool:
        return item in self._new or item in self._old

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def add(self, item: int) -> bool:
        """Add (or refresh) ``item``; True when it was a member."""
        if item in self._new:
            return True
        member = item in self._old
        self._new.add(item)
        if len(self._new) >= self._half:
            self._old, self._new = self._new, set()
        return member


@dataclass(frozen=True)
class Floor:
    """One request's floor: ``tokens`` of its ``new_lines`` (of ``lines`` non-blank lines and tools)."""

    tokens: int = 0
    new_lines: int = 0
    lines: int = 0


class FloorMeter:
    """One app's memory of the lines its requests carried."""

    __slots__ = ("_count", "_lines", "_messages")

    def __init__(self, max_lines: int, count: Callable[[str], int]) -> None:
        self._count = count
        self._lines = SeenSet(max_lines)
        self._messages = SeenSet(max(2, max_lines // 8))

    def measure(self, messages: Sequence[Any], tools: Iterable[Any] = ()) -> Floor:
        """The floor of a request (``messages`` in chat shape, ``tools`` its tool definitions), then
        remember its lines as seen."""
        lines = self._lines
        tokens = new = total = 0
        fresh: list[int] = []
        for tool in tools:
            raw = _tool_text(tool)
            digest = text_hash(raw)
            total += 1
            if digest not in lines:
                new += 1
                tokens += self._count(raw)
                fresh.append(digest)
        for message in messages:
            if not isinstance(message, dict):
                continue
            role = str(message.get("role"))
            text = content_text(message.get("content"))
            whole = text_hash(f"{role}\x00{text}")
            if whole in self._messages:
                self._messages.add(whole)
                total += _non_blank(text)
                continue
            generated = role in GENERATED_ROLES
            for line in text.split("\n"):
                if not line.strip():
                    continue
                total += 1
                digest = text_hash(line)
                if digest in lines or generated:
                    fresh.append(digest)
                    continue
                new += 1
                tokens += self._count(line)
                fresh.append(digest)
            self._messages.add(whole)
        for digest in fresh:
            lines.add(digest)
        return Floor(tokens, new, total)

    def saw_reply(self, message: dict[str, Any] | None) -> None:
        """The backend's reply: its lines are seen from now on (it cached them)."""
        if not message:
            return
        text = content_text(message.get("content"))
        for line in text.split("\n"):
            if line.strip():
                self._lines.add(text_hash(line))


def _non_blank(text: str) -> int:
    return sum(1 for line in text.split("\n") if line.strip())


def _tool_text(tool: Any) -> str:
    try:
        return orjson.dumps(tool, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return repr(tool)
