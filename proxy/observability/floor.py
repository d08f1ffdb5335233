"""The floor: per request, the tokens no arrangement of the prompt can avoid computing.

A request's floor is the tokens of its lines that no earlier request of its app carried (the
model's own replies count as seen: the backend generated, hence cached, them). Direct traffic runs
at several times its floor, the proxy closer to it; the gap is what is left to win, and where.

Per app, a bounded memory of line hashes (two generations: when the newer fills half the bound it
becomes the older and the older is dropped, so a line used again survives); a forgotten line counts
again, so the floor errs high, never low. A message seen whole before is not split into lines again
(an append-only conversation's history costs a hash per message). Blank lines count nothing; each
tool definition counts as one line (its JSON, keys in canonical order).

Measured in bytes (a new line's UTF-8 bytes and its newline); :meth:`Floor.tokens` turns them into
tokens at the request's own rate, the prompt tokens the backend reported per byte of the request, as
the cache-break estimates are calibrated (:mod:`proxy.observability.breaks`): no tokenizer runs on a
request's new text (tiktoken took ~10 ms on a Dify request whose 400 retrieved lines were new).

Pure: no I/O, no clock; the caller serializes access (one event loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from proxy.observability.digests import content_text, message_hash
from proxy.openai import shared_dumps
from proxy.tokenization import TYPICAL_TOKENS_PER_BYTE

# Roles whose text the model generated: seen (cached by the backend when it generated them).
GENERATED_ROLES = frozenset({"assistant"})


def text_hash(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


class LineHashes:
    """:func:`text_hash` of lines (0 for a blank one), each distinct line hashed once: one request's
    lines are read several times (its system prompt as sent and as forwarded, then its floor)."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[str, int] = {}

    def of(self, lines: list[str]) -> tuple[int, ...]:
        known = self._known
        for line in {line for line in lines if line not in known}:
            known[line] = text_hash(line) if line.strip() else 0
        return tuple(map(known.__getitem__, lines))


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

    def update(self, items: list[int]) -> None:
        """Add (or refresh) every item (one request's: the newer generation may pass its half by as many)."""
        self._new.update(items)
        if len(self._new) >= self._half:
            self._old, self._new = self._new, set()

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
    """One request's floor: ``new_bytes`` (its ``new_lines``, tools included) of its ``total_bytes``."""

    new_bytes: int = 0
    total_bytes: int = 0
    new_lines: int = 0

    def tokens(self, prompt_tokens: int = 0) -> int:
        """The new bytes in tokens, at ``prompt_tokens`` (the backend's count) per byte of the request."""
        if not self.new_bytes:
            return 0
        per_byte = prompt_tokens / self.total_bytes if prompt_tokens > 0 and self.total_bytes else 0.0
        return max(1, round(self.new_bytes * (per_byte or TYPICAL_TOKENS_PER_BYTE)))


class FloorMeter:
    """One app's memory of the lines its requests carried."""

    __slots__ = ("_lines", "_messages")

    def __init__(self, max_lines: int) -> None:
        self._lines = SeenSet(max_lines)
        self._messages = SeenSet(max(2, max_lines // 8))

    def measure(
        self, messages: Sequence[Any], tools: Sequence[Any] = (), line_hashes: LineHashes | None = None
    ) -> Floor:
        """The floor of a request (``messages`` in chat shape, ``tools`` its tool definitions), then
        remember its lines as seen."""
        lines, wholes = self._lines, self._messages
        newer, older = lines._new, lines._old
        hashing = line_hashes or LineHashes()
        total_bytes = new = new_bytes = 0
        fresh: list[int] = []
        if tools:
            every = shared_dumps(list(tools))
            total_bytes += len(every)
            key = xxhash.xxh3_64_intdigest(every)
            if key not in wholes:
                for tool in tools:
                    raw = _tool_text(tool)
                    digest = text_hash(raw)
                    fresh.append(digest)
                    if digest not in newer and digest not in older:
                        new += 1
                        new_bytes += len(raw.encode("utf-8", "surrogatepass")) + 1
            wholes.add(key)
        for message in messages:
            if not isinstance(message, dict):
                continue
            # The hash and size the cache-break digests use (a long text's kept by the string).
            whole, size = message_hash(message)
            total_bytes += size + 1
            if wholes.add(whole):
                continue  # seen whole before: every line of it too
            split = content_text(message.get("content")).split("\n")
            hashes = hashing.of(split)
            fresh.extend(digest for digest in hashes if digest)
            if message.get("role") not in GENERATED_ROLES:
                for line, digest in zip(split, hashes, strict=True):
                    if digest and digest not in newer and digest not in older:
                        new += 1
                        new_bytes += len(line.encode("utf-8", "surrogatepass")) + 1
        lines.update(fresh)
        return Floor(new_bytes, total_bytes, new)

    def saw_reply(self, message: dict[str, Any] | None) -> None:
        """The backend's reply: its lines are seen from now on (it cached them)."""
        if not message:
            return
        text = content_text(message.get("content"))
        for line in text.split("\n"):
            if line.strip():
                self._lines.add(text_hash(line))


def _tool_text(tool: Any) -> str:
    try:
        return orjson.dumps(tool, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return repr(tool)
