"""Which conversation a request belongs to. Pure functions, no I/O.

Explicit ids win (a header, ``prompt_cache_key``, or ``user`` when enabled).
Otherwise a conversation is recognized by *adjacent-message fingerprints*: a
64-bit hash of each pair (previous message, message) of the non-system history,
in canonical form. Pairs survive a sliding memory window (dropping the oldest
messages leaves every later pair intact), while two conversations that share a
first message ("hi") part ways at the first model reply, which is unique. The
request is attributed to the known session whose shared pairs weigh most (a
pair weighs its position: later pairs are more specific; ties go to the most
recently active session); no shared pair means a new session.

Only the history before the newest message is looked up, so a request without
history (a conversation's first message) always opens a new session.

Limits: a conversation whose client rewrites every message (not only ids or
whitespace, which canonicalization already fixes) cannot be followed; a
conversation resent from scratch with identical content after its TTL starts
over as a new session; a client whose window keeps only the newest message
sends no history, so each of its requests is a new session (give it an explicit
id); two conversations whose histories are identical so far (same messages,
same replies) are one conversation as far as any observer can tell, and are told
apart from the first message in which they differ.

Openings: a conversation's first pair (the start and its first message) is also indexed under
:func:`opening_key` for the session it opened. A request that starts with another live session's
opening re-sends that conversation, never a window slid over this one: with deterministic replies, a
conversation whose whole history equals the end of another's shares every pair with it but its
first, and where it began is what tells the two apart (``SessionService``).
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, repeat
from operator import eq
from typing import Any

import xxhash

from proxy.openai import STABLE_ROLES, link_hash, message_fingerprint

_START = 0x5EED
# Seeds the index key of a conversation's opening (:func:`opening_key`), apart from every pair.
_OPENED = 0x09E4ED


def pair_fingerprint(previous: int, current: int) -> int:
    return link_hash(previous, current)


def opening_key(first_pair: int) -> int:
    """Where the pair index holds the session that opened with ``first_pair`` (a request's first
    pair: the start and its first non-system message). Not a pair of any conversation, so a window
    that slid, whose first pair is a later message's, never takes it."""
    return link_hash(_OPENED, first_pair)


# A message and its :func:`message_fingerprint`.
MessageFingerprint = tuple[Mapping[str, Any], int]


@dataclass(slots=True)
class Recorded:
    """Where a request's pairs went once its turn was recorded: every one of its first ``pairs``
    fingerprints, and its reply's pair, were ``session_id``'s in ``tenant`` when the store's
    ``token`` for that session read as kept here (``MemorySessionStore.pair_token``). Filled in
    by the turn's record; empty until then (and for a request whose pairs were not all recorded)."""

    tenant: str = ""
    session_id: str | None = None
    pairs: int = 0
    reply_pair: int = 0
    token: tuple[int, int] | None = None


@dataclass(slots=True, frozen=True)
class Fingerprinted:
    """:func:`conversation_fingerprints` of a message list, and where it stood after each of its
    first ``i`` messages (``counts[i]`` pairs, ``previous[i]`` the last fingerprint): what a request
    that re-sends those messages resumes from; and, once its turn is recorded, which session its
    pairs went to (``recorded``)."""

    pairs: list[int]
    counts: array[int]
    previous: array[int]
    recorded: Recorded = field(default_factory=Recorded)


def conversation_fingerprints(
    messages: Sequence[Mapping[str, Any]], resumed: Fingerprinted | None = None, shared: int = 0
) -> tuple[list[int], MessageFingerprint | None, Fingerprinted]:
    """Pair fingerprints of the non-system messages, in order; the last of those messages with its
    own fingerprint (None without any); and what a later request may resume from. ``resumed``:
    that of a list whose first ``shared`` messages equal these (:mod:`proxy.openai.continuation`)."""
    if resumed is not None and shared:
        pairs = resumed.pairs[: resumed.counts[shared]]
        counts = resumed.counts[: shared + 1]
        previous_at = resumed.previous[: shared + 1]
    else:
        shared = 0
        pairs, counts, previous_at = [], array("Q", [0]), array("Q", [_START])
    previous = previous_at[-1]
    last: MessageFingerprint | None = None
    for message in messages[shared:]:
        if message.get("role") not in STABLE_ROLES:
            current = message_fingerprint(message)
            pairs.append(pair_fingerprint(previous, current))
            previous = current
            last = (message, current)
        counts.append(len(pairs))
        previous_at.append(previous)
    if last is None and pairs:
        # The newest non-system message is in the resumed part: the same fingerprint, this request's message.
        index = shared - 1
        while messages[index].get("role") in STABLE_ROLES:
            index -= 1
        last = (messages[index], previous)
    return pairs, last, Fingerprinted(pairs[:], counts, previous_at)


def conversation_root(messages: Sequence[Mapping[str, Any]]) -> int | None:
    """The fingerprint of a conversation's first non-system message (its first pair's), or None.

    Every turn of a conversation re-sends it, so it names the conversation without any state; two
    conversations that open alike share it, and share that much of their prefix too.
    """
    first = next((m for m in messages if m.get("role") not in STABLE_ROLES), None)
    return None if first is None else pair_fingerprint(_START, message_fingerprint(first))


def reply_fingerprint(
    messages: Sequence[Mapping[str, Any]], reply: Mapping[str, Any], known: MessageFingerprint | None = None
) -> int | None:
    """The pair the model's reply will form with the last message, once the client re-sends it.
    ``known``: a message already fingerprinted, used when it is that last message."""
    last = next((m for m in reversed(messages) if m.get("role") not in STABLE_ROLES), None)
    if last is None:
        return None
    last_print = known[1] if known is not None and known[0] is last else message_fingerprint(last)
    return pair_fingerprint(last_print, message_fingerprint(reply))


def vote(matches: list[str | None], last_seen: Mapping[str, float], first: int = 1) -> str | None:
    """The session whose pairs match best; ties go to the most recently active one.

    A pair counts by its position: later pairs are more specific to one conversation
    (an opening "hi" is shared by many; the pair after the model's first reply is not).
    ``first``: the position of ``matches[0]`` (the pairs before it matched elsewhere:
    :func:`weigh` them and pass ``weights``).
    """
    return elect(weights(matches, first), last_seen)


def weights(matches: list[str | None], first: int = 1) -> dict[str, int]:
    """Each matched session's weight: the sum of the positions of its pairs (``matches[0]``'s
    position being ``first``). A pass in C per session matched (a conversation's pairs name one
    or a few)."""
    found: dict[str, int] = {}
    for session_id in dict.fromkeys(matches):
        if session_id:
            found[session_id] = sum(compress(count(first), map(eq, matches, repeat(session_id))))
    return found


def elect(counts: Mapping[str, int], last_seen: Mapping[str, float]) -> str | None:
    """The session of the greatest weight; ties to the most recently active, then the greatest id."""
    if not counts:
        return None
    return max(counts, key=lambda sid: (counts[sid], last_seen.get(sid, 0.0), sid))


@functools.lru_cache(maxsize=16)
def _header_ranks(names: tuple[str, ...]) -> dict[str, int]:
    """Each session header's place in the order of preference (case-insensitive; first wins)."""
    ranks: dict[str, int] = {}
    for rank, name in enumerate(names):
        ranks.setdefault(name.lower(), rank)
    return ranks


def explicit_session_id(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    *,
    header_names: Sequence[str],
    use_prompt_cache_key: bool,
    use_user: bool,
) -> str | None:
    """The session the client names: the first of ``header_names`` it sent, else ``prompt_cache_key``,
    else (``use_user``) ``user``."""
    value: Any = None
    # One pass over the headers sent (Starlette's scan the whole list for each name asked for).
    # Names are case-insensitive; of repeated ones the first counts, as Starlette reads them.
    ranks = _header_ranks(tuple(header_names))
    found: dict[int, str] = {}
    for name, sent in headers.items():
        rank = ranks.get(name.lower())
        if rank is not None and rank not in found:
            found[rank] = sent
    for rank in sorted(found):
        if value := found[rank]:
            break
    if not value and use_prompt_cache_key:
        value = body.get("prompt_cache_key")
    if not value and use_user:
        value = body.get("user")
    if not isinstance(value, str) or not value.strip():
        return None
    value = value.strip()
    # Client-chosen ids are hashed so they can neither collide with inferred ids nor inject key syntax.
    return "x" + xxhash.xxh3_128_hexdigest(value.encode("utf-8", "surrogatepass"))[:31]
