"""Where each conversation's moved lines went: what the proxy forwarded, as hashes.

Relocation decides, per request, where the volatile lines of the system prompt go. The
cheapest place is wherever the backend already saw them: a conversation whose lines did
not change since its last turn must get them at the same position again, or the turn
recomputes everything after the old position (a direct connection would not). So the
proxy remembers, as 64-bit hashes (no text):

- each forwarded prompt: a request that extends one beyond its system messages, lines
  left in the system prompt, continues a conversation that was forwarded that way, and
  keeps that layout;
- each inserted block by its position in the conversation (the history before it and
  the message after it), with the hashes of the lines it held: the next turn moves the
  same lines there again, if they are all still in its system prompt.

The chains cover the tenant, the model, the tools and every message byte (as JSON), so two
conversations share an entry only when their histories are the same.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, count, islice
from typing import Any

import xxhash

from proxy.openai import LONG_TEXT_CHARS, ByText, Continuations, dumps, link_hash, shared_dumps
from proxy.recent import RecentMap, RecentSet

# (system message index, text part, line hash) of one moved line.
MovedLine = tuple[int, int, int]
Block = tuple[MovedLine, ...]

# Conversations of different apps can open alike ("hi"): a position keeps this many blocks.
BLOCKS_PER_POSITION = 16
# Positions of the blocks written last that are kept (``ForwardedLayouts.written_since``).
WRITES_KEPT = 4096


@dataclass(frozen=True, slots=True)
class Digested:
    """What a conversation's next request resumes from (``ForwardedLayouts.digested``): the
    digests of the last request's history (its messages after the leading system messages), and
    the chain over them under its header (``chain[k]``: the header and the first ``k``)."""

    digests: array[int]
    header: int
    chain: array[int]
    # Where the history's system messages are (a client's own, mid-conversation).
    systems: list[int]
    # Where blocks had been inserted in the history (its offsets), as of ``mark`` blocks written
    # (``ForwardedLayouts.written``).
    blocks: list[int]
    mark: int
    # What the next request's restorations start from (``relocation._Layout.restorations``):
    # which blocks' lines are where (a moved line -> the offsets of the blocks that hold it, for
    # every block at ``blocks``), and the offsets whose blocks were all in the system texts (by
    # message and text part, each with its lines' hashes) of a request of the conversation. A
    # block can be held by the next request only if it was held then, is new, or holds a line
    # that is new in its system texts: only those are looked at, not every block of a long
    # conversation.
    line_offsets: dict[MovedLine, frozenset[int]] = field(default_factory=dict)
    system_texts: dict[tuple[int, int], tuple[str, frozenset[int]]] | None = None
    held: frozenset[int] = frozenset()


class ForwardedLayouts:
    """Bounded memories (least recently used out) of forwarded prompts and inserted blocks."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self._prompts: RecentSet[int] = RecentSet(max_entries)
        self._blocks: RecentMap[int, tuple[Block, ...]] = RecentMap(max(1, max_entries // 4))
        # Apps (hashed) that have had a block inserted: only their requests look for one.
        self._apps: RecentSet[int] = RecentSet(max(1, max_entries // 16))
        # Openings (hashed, by app) of one-shot requests' user turns: a user turn that opens the way an
        # earlier one of the app did is a template (see relocation.TEMPLATE_OPENING_CHARS).
        self._openings: RecentSet[int] = RecentSet(max(1, max_entries // 16))
        # Per tenant and conversation, the digests of the last request's messages (relocation's
        # chains resume from them).
        self.digested: Continuations[Digested] = Continuations()
        # Blocks written so far, and the positions of the last ``WRITES_KEPT``: a conversation's
        # request looks for blocks in its history only where they were written since its last one.
        self.written = 0
        self._writes: deque[int] = deque(maxlen=WRITES_KEPT)

    def remember_prompt(self, key: int) -> None:
        self._prompts.add(key)

    def knows_prompt(self, key: int) -> bool:
        return self._prompts.touch(key)

    def remember_block(self, position: int, block: Block, app: int) -> None:
        known = self._blocks.peek(position) or ()
        self._blocks[position] = (block, *(b for b in known if b != block))[:BLOCKS_PER_POSITION]
        self._apps.add(app)
        self.written += 1
        self._writes.append(position)

    def written_since(self, mark: int) -> list[int] | None:
        """The positions blocks were written at since ``written`` read ``mark``; None when more
        were written than are kept."""
        count = self.written - mark
        if count > len(self._writes):
            return None
        return list(islice(reversed(self._writes), count))

    def blocks_at(self, position: int) -> tuple[Block, ...]:
        """The blocks inserted at this position, most recent first."""
        return self._blocks.get(position) or ()

    def with_blocks(self, positions: Sequence[int], start: int = 0) -> list[int]:
        """The indices of ``positions`` (from ``start``) where blocks were inserted, in order. One
        pass in C, reading nothing (no use of an entry)."""
        return list(compress(count(start), map(self._blocks.holds, positions[start:])))

    def app_had_blocks(self, app: int) -> bool:
        return app in self._apps

    def remember_opening(self, key: int) -> bool:
        """Remember a user turn's opening; True when it was remembered already."""
        return self._openings.add(key)

    def __len__(self) -> int:
        return len(self._prompts) + len(self._blocks)


def chain_header(namespace: str, body: dict[str, Any]) -> int:
    """The start of every chain: what the backend renders ahead of the messages."""
    digest = xxhash.xxh3_64()
    digest.update(namespace.encode("utf-8", "surrogatepass"))
    digest.update(b"\x00")
    digest.update(str(body.get("model", "")).encode("utf-8", "surrogatepass"))
    digest.update(b"\x00")
    tools = body.get("tools") or body.get("functions")
    digest.update(shared_dumps(tools) if tools else b"[]")  # no list made (and kept) per tool-less request
    return digest.intdigest()


# A message of a role and a long text is serialized and hashed once per text string
# (``LONG_TEXT_CHARS``), with the keys in their order and the role.
_LONG_TEXT_DIGESTS: ByText[int] = ByText()


def message_digest(message: Any) -> int:
    """xxh3 of the message's JSON (orjson's bytes)."""
    if type(message) is dict and len(message) == 2:
        text, role = message.get("content"), message.get("role")
        if type(text) is str and len(text) >= LONG_TEXT_CHARS and type(role) is str:
            # The keys in their order and the role (a string: 1 == 1.0 == True) fix the rest of the JSON.
            rest = (*message, role)
            known = _LONG_TEXT_DIGESTS.get(text, rest)
            if known is None:
                known = xxhash.xxh3_64_intdigest(dumps(message))
                _LONG_TEXT_DIGESTS.put(text, rest, known)
            return known
    return xxhash.xxh3_64_intdigest(dumps(message))


def extend(chain: int, digest: int) -> int:
    return link_hash(chain, digest)
