"""Anchoring: the summary replaces the messages it stands for, right after the stable system prefix.

Pure functions. The summarized messages are recognized by fingerprint whether
the client re-sends all of them, only some (its window slid), or none. Between
two compactions the forwarded prefix ``[system, summary, kept turns...]`` is
byte-identical, so the backend keeps hitting its cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, count
from operator import eq, not_, or_
from typing import Any

from proxy.openai import is_text_parts, message_fingerprint, message_text, utf8_size
from summarizer.state import SummaryState

SUMMARY_HEADER = "Summary of the earlier part of this conversation:"
# An inferred conversation is repaired only when the client re-sends this many replies the backend
# generated for it: one reply can repeat in another conversation (greedy decoding, the same question),
# a run of them in the same order hardly.
MIN_REPLIES_IN_OVERLAP = 2


def summary_message(state: SummaryState) -> dict[str, Any]:
    return {"role": "system", "content": f"{SUMMARY_HEADER}\n{state.text}"}


def is_summary_message(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return message.get("role") == "system" and isinstance(content, str) and content.startswith(SUMMARY_HEADER)


@dataclass(frozen=True)
class Known:
    """What the proxy worked out of these very messages already (the session's fingerprints, the
    budget's sizes), so that the messages a summary stands for are found in passes of C, not by
    fingerprinting and sizing each again: after message ``i``, ``counts[i + 1]`` pairs (one more
    than ``counts[i]`` where it is not a system message, and then ``after[i + 1]`` is its
    :func:`message_fingerprint`), and ``ends[i]``, the size of ``messages[:i]`` as
    ``message_text``'s UTF-8 bytes and 8 a message."""

    after: Sequence[int]
    counts: Sequence[int]
    ends: Sequence[int]


@dataclass
class Anchored:
    messages: list[dict[str, Any]]
    removed: int = 0
    removed_bytes: int = 0
    restored: int = 0
    actions: list[str] = field(default_factory=list)
    # Index of the first message after the summary (or after the system prefix when there is none).
    history_start: int = 0
    # Where the summary went in the input (the messages before it are kept as they were).
    insert_at: int = 0

    def position(self, index: int) -> int | None:
        """Where the input's message ``index`` is in :attr:`messages`; None when the summary
        replaced it."""
        if index < self.insert_at:
            return index
        if index < self.insert_at + self.removed:
            return None
        return self.history_start + self.restored + index - self.insert_at - self.removed


def anchor(
    messages: list[dict[str, Any]],
    state: SummaryState,
    insert_at: int,
    *,
    repair: bool = False,
    repair_needs_reply: bool = False,
    into_system: bool = False,
    system_tail: str = "",
    known: Known | None = None,
) -> Anchored:
    """Replace the leading covered messages after ``insert_at`` with the summary (and repair the window).

    ``into_system``: for chat templates that refuse a second system message (Mistral's, Gemma's),
    the summary joins the system message before it instead, ahead of ``system_tail`` (volatile lines
    moved to that message's end), so it stays in the stable prefix.
    """
    head, rest = messages[:insert_at], messages[insert_at:]
    removed = 0
    if state.covered and known is not None:
        removed = _covered(rest, insert_at, state.covered, known)
    elif state.covered:
        while removed < len(rest) and message_fingerprint(rest[removed]) in state.covered:
            removed += 1
    if known is not None:
        removed_bytes = known.ends[insert_at + removed] - known.ends[insert_at] - 8 * removed
    else:
        removed_bytes = sum(utf8_size(message_text(m)) for m in rest[:removed])
    rest = rest[removed:]
    restored = _restore_dropped(rest, state.tail, repair_needs_reply) if repair else []
    out = list(head)
    actions = []
    if state.active:
        merged = _merged_into(out[-1], state, system_tail) if into_system and out else None
        if merged is not None:
            out[-1] = merged
            actions.append("summary_in_system_message")
        else:
            out.append(summary_message(state))
        actions.append(f"summary_anchored:v{state.version}")
    if removed:
        actions.append(f"summary_replaced_messages:{removed}")
    if restored:
        actions.append(f"window_repaired:{len(restored)}")
    history_start = len(out)
    out.extend(restored)
    out.extend(rest)
    return Anchored(out, removed, removed_bytes, len(restored), actions, history_start, insert_at)


def _covered(rest: list[dict[str, Any]], offset: int, covered: set[int], known: Known) -> int:
    """How many leading messages of ``rest`` (``messages[offset:]``) the summary stands for: their
    fingerprints looked up in passes of C, a system message's made here (its own is not kept)."""
    after, counts = known.after, known.counts
    removed, end = 0, len(rest)
    while removed < end:
        first, last = offset + removed, offset + end
        stops = map(
            or_,
            map(not_, map(covered.__contains__, after[first + 1 : last + 1])),
            map(eq, counts[first + 1 : last + 1], counts[first:last]),
        )
        removed = next(compress(count(removed), stops), end)
        if removed == end or counts[offset + removed + 1] != counts[offset + removed]:
            break  # not a system message: not covered
        if message_fingerprint(rest[removed]) not in covered:
            break
        removed += 1
    return removed


def _merged_into(system: dict[str, Any], state: SummaryState, tail: str) -> dict[str, Any] | None:
    content = system.get("content")
    if system.get("role") != "system":
        return None
    summary = summary_message(state)["content"]
    if is_text_parts(content):
        # Text parts: the summary is a part of its own, before a last part of moved volatile lines.
        part = {"type": "text", "text": summary}
        if tail and content[-1]["text"] == tail:
            return {**system, "content": [*content[:-1], part, content[-1]]}
        return {**system, "content": [*content, part]}
    if not isinstance(content, str):
        return None
    if tail and content.endswith(tail):
        stable = content[: -len(tail)].rstrip("\n")
        return {**system, "content": f"{stable}\n\n{summary}\n\n{tail}" if stable else f"{summary}\n\n{tail}"}
    return {**system, "content": f"{content}\n\n{summary}"}


def _restore_dropped(
    rest: list[dict[str, Any]], tail: list[dict[str, Any]], needs_reply: bool = False
) -> list[dict[str, Any]]:
    """Messages of the remembered tail that the client dropped from the front of its window.

    Only a clean slide is repaired: the client must re-send every remembered message
    from its window's first one to the last reply, byte for byte in canonical form, and
    then its new ones. Anything else (an edited history, or a conversation that merely
    shares a message with this one) is left alone. ``needs_reply`` (an inferred identity): the
    re-sent part must hold a reply the backend generated for this conversation.
    """
    if not rest or not tail:
        return []
    tail_prints = [message_fingerprint(m) for m in tail]
    first = message_fingerprint(rest[0])
    if first not in tail_prints:
        return []
    start = tail_prints.index(first)
    remaining = len(tail) - start
    if start == 0 or len(rest) <= remaining:
        return []
    if any(tail_prints[start + i] != message_fingerprint(rest[i]) for i in range(remaining)):
        return []
    if needs_reply and sum(m.get("role") == "assistant" for m in tail[start:]) < MIN_REPLIES_IN_OVERLAP:
        return []  # too little the backend generated for this conversation to prove it is this one
    return tail[:start]
