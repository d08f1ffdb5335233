"""Moving volatile lines of a system prompt behind its stable part, values unchanged."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from proxy.canon.volatile import Span


def split_lines(text: str) -> list[str]:
    return text.split("\n")


def lines_touched(text: str, spans: Iterable[Span]) -> set[int]:
    """Indices of the lines any span overlaps (a span moves with its whole lines)."""
    starts = [0]
    position = text.find("\n")
    while position >= 0:
        starts.append(position + 1)
        position = text.find("\n", position + 1)
    touched: set[int] = set()
    for span in spans:
        first = _line_of(starts, span.start)
        last = _line_of(starts, max(span.start, span.end - 1))
        touched.update(range(first, last + 1))
    return touched


def _line_of(starts: list[int], offset: int) -> int:
    lo, hi = 0, len(starts) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if starts[mid] <= offset:
            lo = mid
        else:
            hi = mid - 1
    return lo


def partition_lines(lines: list[str], volatile: set[int]) -> tuple[str, str]:
    """Split into (stable text, moved text): every line goes to exactly one side, byte for byte
    (indentation, trailing spaces, blank lines inside a block and the CR of CRLF included), and both
    sides keep the lines' original order.

    One blank line that separated a moved run from the text on both sides (or from the text's start
    or end) travels with the run, so the stable text keeps one paragraph break where it had two; when
    only blank lines would stay, they all go. Nothing is added or dropped.
    """
    moving = set(volatile)
    for first, last in runs(lines, sorted(volatile), bridge_blank=False):
        before_blank = first == 0 or _blank(lines[first - 1])
        after_blank = last == len(lines) - 1 or _blank(lines[last + 1])
        if not (before_blank and after_blank):
            continue
        if last + 1 < len(lines) and _blank(lines[last + 1]) and last + 1 not in moving:
            moving.add(last + 1)
        elif first > 0 and _blank(lines[first - 1]) and first - 1 not in moving:
            moving.add(first - 1)
    stable = [line for i, line in enumerate(lines) if i not in moving]
    if all(_blank(line) for line in stable):
        # Nothing but blank lines would stay: they go along, so no byte is lost with the emptied text.
        return "", "\n".join(lines)
    moved = [line for i, line in enumerate(lines) if i in moving]
    return "\n".join(stable), "\n".join(moved)


def already_at_end(lines: list[str], volatile: set[int]) -> bool:
    """True when nothing but blank lines follows the first volatile line that is not itself volatile."""
    if not volatile:
        return True
    return all(i in volatile or _blank(lines[i]) for i in range(min(volatile), len(lines)))


def _blank(line: str) -> bool:
    return not line.strip()


def runs(lines: list[str], indices: list[int], *, bridge_blank: bool) -> list[tuple[int, int]]:
    """Maximal runs of consecutive line indices (sorted), as (first, last); ``bridge_blank``: blank
    lines between two indices do not end a run."""
    found: list[tuple[int, int]] = []
    for index in indices:
        gap = lines[found[-1][1] + 1 : index] if found else None
        if gap is not None and (not gap or (bridge_blank and all(_blank(line) for line in gap))):
            found[-1] = (found[-1][0], index)
        else:
            found.append((index, index))
    return found


# -- whole regions: what moves is a block of the client's text, never a part of one ---------------

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_OPEN_TAG = re.compile(r"^\s*<([A-Za-z][\w.:-]*)(?:\s[^<>]*)?>\s*$")
_CLOSE_TAG = re.compile(r"^\s*</([A-Za-z][\w.:-]*)\s*>\s*$")


def weak_lines(lines: list[str]) -> set[int]:
    """Lines that cannot anchor a template: blank, without a letter or digit (```, ---), a closing
    tag (</doc>), or occurring more than once in the text."""
    counts = Counter(lines)
    return {
        i
        for i, line in enumerate(lines)
        if not line.strip() or counts[line] > 1 or not any(c.isalnum() for c in line) or _CLOSE_TAG.match(line)
    }


def widen(lines: list[str], varying: set[int], weak: set[int]) -> set[int]:
    """Each run of varying lines extended over the weak lines around it, up to strong lines (blank
    lines at the ends of a widened run left out: they stay paragraph breaks)."""
    widened = set(varying)
    for index in sorted(varying):
        low = index
        while low - 1 >= 0 and low - 1 in weak and low - 1 not in widened:
            low -= 1
        high = index
        while high + 1 < len(lines) and high + 1 in weak and high + 1 not in widened:
            high += 1
        while low < index and _blank(lines[low]):
            low += 1
        while high > index and _blank(lines[high]):
            high -= 1
        widened.update(range(low, high + 1))
    return widened


def bridge_blanks(lines: list[str], moving: set[int]) -> set[int]:
    """``moving`` with the blank lines between two of its lines (nothing else between): a moved
    block keeps its inner paragraph breaks."""
    bridged = set(moving)
    for first, last in runs(lines, sorted(moving), bridge_blank=True):
        bridged.update(range(first, last + 1))
    return bridged


def _introduces(line: str) -> bool:
    stripped = line.rstrip()
    return stripped.endswith((":", "：")) and any(c.isalnum() for c in stripped)
