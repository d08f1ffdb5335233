"""Moving volatile lines of a system prompt behind its stable part, values unchanged."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, TypeGuard

from proxy.canon.volatile import Span

_EXCESS_BLANK_LINES = re.compile(r"\n{3,}")


def is_text_parts(content: Any) -> TypeGuard[list[dict[str, Any]]]:
    """Content given as text parts only (``[{"type": "text", "text": ...}, ...]``)."""
    return (
        isinstance(content, list)
        and bool(content)
        and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
    )


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
    """Split into (stable text, volatile text); both keep their lines' original order."""
    stable = [line for i, line in enumerate(lines) if i not in volatile]
    moved = [line for i, line in enumerate(lines) if i in volatile]
    stable_text = _EXCESS_BLANK_LINES.sub("\n\n", "\n".join(stable)).strip("\n")
    moved_text = "\n".join(line for line in moved if line.strip())
    return stable_text, moved_text
