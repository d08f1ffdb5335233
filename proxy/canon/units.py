"""Units: the structure a text gives itself, and the whole units a set of lines belongs to.

What relocation moves out of a system prompt must read the same where it lands: a status line moved
without its ``Git status:`` label reads as nothing in particular, and an ``<env>`` wrapper left with
nothing inside says nothing. So a move takes whole units of the client's text, found from the
text's own marks (never from one client's wording):

- a fenced block (````` or ``~~~`` up to the fence that closes it), its fences as its framing; in
  it, each run of lines between blank lines moves whole or stays (code read line by line is torn),
  and a tagged element is an element (a prompt written as XML in a fence);
- a tagged element (a line opening with ``<name ...>``, attributes and text after the tag allowed,
  up to the line that ends with its ``</name>``), tags included;
- a labelled group: a line ending with ``:`` and what it introduces (the following lines up to a
  blank line or the next label at its indentation; a label ending its paragraph introduces the next
  unit, such as the ``<env>`` element right after ``Here is useful information ...:``, and so does a
  label right before another label or a heading: ``Context:`` then a retrieved README that opens
  with ``# title``, or code that opens with ``def f(a, b):``);
- a list item (``-``, ``*``, ``+``, ``•``, ``1.``, ``1)``) with its more indented continuation;
- a section: a Markdown heading and what follows up to a heading of its level or above;
- a listing: the run of other lines a label introduces (``Status:`` then ``git status --short``'s
  lines, ``Recent commits:`` then one a line), whole;
- a run: a paragraph that opens with a ``key: value`` line, which heads the lines after it
  (``gitStatus: This is the git status at the start ...`` then ``Current branch: main``); the opening
  line goes along when every line it heads moves, and moves alone where it varies itself;
- every other line, a unit of its own: a ``key: value`` line (``Today's date: 2026-12-04``), a
  sentence of an instruction.

Units nest. The framing of a unit that has one (a label, a heading, an item's first line, an
element's tag lines) stays exactly when some of its content stays: a set of moving lines is made
whole (:meth:`Units.whole`) by taking, innermost first, every run of code it touches and every framed unit
whose framing it touches or whose content it takes entirely. Nothing that did not vary is taken
otherwise: a date inside ``<env>`` next to a working directory moves alone, a key: value line of
its own.

The tree is a pure function of the text, built in one pass over its lines (each line classified
once, a distinct line once per process) and kept by the text's digest: a system prompt seen before
costs a lookup. Which lines a set makes whole is kept with the tree.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, count
from operator import add

import xxhash
from cachetools import LRUCache

from proxy.openai import shared_length

_FENCE = re.compile(r"\s*(`{3,}|~{3,})")
_OPEN_TAG = re.compile(r"\s*<([A-Za-z][\w.:-]*)(?:\s[^<>]*)?>")
_CLOSE_TAG = re.compile(r"</([A-Za-z][\w.:-]*)\s*>\s*$")
_HEADING = re.compile(r" {0,3}(#{1,6})\s+\S")
_ITEM = re.compile(r"\s*(?:[-*+•]|\d{1,3}[.)])\s+\S")
_LABEL_END = (":", "：")
# A key (a few words, no colon) then its value on the same line; a colon then a space (a URL, a
# clock reading have none), or a full-width colon.
_PAIR = re.compile(r"\s*(?:[-*+•]\s+)?[^\s:：<][^:：]{0,59}?(?::\s+\S|：\s*\S)")
_PAIR_WORDS = 8

# Kinds of unit. Framed kinds keep their framing (head, tail) only while some content stays.
FENCE, ELEMENT, GROUP, ITEM, SECTION = "fence", "element", "group", "item", "section"
LINE, LISTING, CODE = "line", "listing", "code"
# A paragraph opened by a ``key: value`` line: its head goes along with all of the rest, and that alone.
RUN = "run"
# Units taken whole once touched.
ATOMIC = frozenset({LISTING, CODE})
FRAMED = frozenset({FENCE, ELEMENT, GROUP, ITEM, SECTION})
# Sets of moving lines kept per tree (a text meets few: what varies in it, and the same plus a line).
_WHOLES_KEPT = 32


@dataclass(frozen=True, slots=True)
class Unit:
    """Lines ``first`` to ``last`` (inclusive) of a text. ``head``/``tail``: the first/last line is the
    unit's framing (a label, a heading, an item's line, an element's tags), not in ``children``."""

    first: int
    last: int
    kind: str
    children: tuple[Unit, ...] = ()
    head: bool = False
    tail: bool = False

    def walk(self) -> Iterable[Unit]:
        yield self
        for child in self.children:
            yield from child.walk()


class _Line:
    """How one line reads (the same wherever the line occurs)."""

    __slots__ = ("blank", "close", "fence", "heading", "indent", "item", "label", "open", "pair", "reading", "uniform")

    def __init__(self, line: str) -> None:
        stripped = line.strip()
        self.blank = not stripped
        self.indent = len(line) - len(line.lstrip(" \t"))
        fence = _FENCE.match(line) if "`" in line or "~" in line else None
        self.fence = (fence.group(1)[0], len(fence.group(1))) if fence else None
        # A line of one fence character only can close a fence of that character no longer than it.
        uniform = len(stripped) >= 3 and stripped[0] in "`~" and stripped == stripped[0] * len(stripped)
        self.uniform = (stripped[0], len(stripped)) if uniform else None
        self.open: str | None = None
        self.close: str | None = None
        if "<" in line:
            opening = _OPEN_TAG.match(line)
            closing = _CLOSE_TAG.search(line)
            self.close = closing.group(1) if closing else None
            if opening and not opening.group(0).endswith("/>"):
                name = opening.group(1)
                # An element opened and closed on its line is that line.
                if f"</{name}" not in line[opening.end() :]:
                    self.open = name
        heading = _HEADING.match(line) if stripped[:1] == "#" else None
        self.heading = len(heading.group(1)) if heading else 0
        self.item = bool(stripped) and (stripped[0] in "-*+•" or stripped[0].isdigit()) and bool(_ITEM.match(line))
        self.label = stripped.endswith(_LABEL_END) and any(c.isalnum() for c in stripped) and not self.heading
        pair = _PAIR.match(line) if ":" in line or "：" in line else None
        self.pair = pair is not None and len(pair.group(0).split()) <= _PAIR_WORDS + 1
        # All the parser reads of the line: two lines that read alike give a text the same tree.
        self.reading = (
            self.blank,
            self.indent,
            self.fence,
            self.uniform,
            self.open,
            self.close,
            self.heading,
            self.item,
            self.label,
            self.pair,
        )


# Each distinct line is read once (lines recur across an app's prompts and across requests).
_LINES: LRUCache[str, _Line] = LRUCache(65_536)


def _read(line: str) -> _Line:
    found = _LINES.get(line)
    if found is None:
        found = _LINES[line] = _Line(line)
    return found


class Units:
    """The unit tree of one text: ``roots`` (in order), line offsets and what sets of lines make whole."""

    __slots__ = ("_framing", "_lines", "_nonblank", "_starts", "_wholes", "roots")

    def __init__(self, text: str | None, lines: list[str] | None = None, like: Units | None = None) -> None:
        lines = lines if lines is not None else (text or "").split("\n")
        # Where each line starts, made when a span is asked for (most requests ask none).
        self._lines: list[str] | None = lines
        self._starts: list[int] | None = None
        self._nonblank: list[int]
        self.roots: tuple[Unit, ...]
        self._wholes: dict[frozenset[int], frozenset[int]]
        self._framing: frozenset[int] | None
        if like is not None:
            # The tree of a text whose lines read alike line for line (``_alike``): the same units.
            self._nonblank, self.roots, self._wholes = like._nonblank, like.roots, like._wholes
            self._framing = like._framing
            return
        reads = [_read(line) for line in lines]
        self._nonblank = [0, *accumulate(not read.blank for read in reads)]
        self.roots = _Parser(reads).parse()
        self._wholes = {}
        self._framing = None

    @classmethod
    def same_lines(cls, like: Units) -> Units:
        """The tree of a text whose lines are as long as ``like``'s and read alike: its line offsets too."""
        found = cls.__new__(cls)
        found._lines, found._starts = like._lines, like._starts
        found._nonblank, found.roots, found._wholes, found._framing = (
            like._nonblank,
            like.roots,
            like._wholes,
            like._framing,
        )
        return found

    @property
    def line_count(self) -> int:
        return len(self._nonblank) - 1

    @property
    def starts(self) -> list[int]:
        if self._starts is None:
            self._starts = _starts(self._lines or [""])
            self._lines = None
        return self._starts

    def span(self, unit: Unit) -> tuple[int, int]:
        """The unit's characters in the text: ``text[start:end]``, its last line's newline excluded."""
        return self.starts[unit.first], self.starts[unit.last + 1] - 1

    def units(self) -> Iterable[Unit]:
        for root in self.roots:
            yield from root.walk()

    def framing(self) -> frozenset[int]:
        """The lines that frame a unit (labels, headings, items' lines, tags, fences)."""
        if self._framing is None:
            found = set()
            for unit in self.units():
                if unit.head:
                    found.add(unit.first)
                if unit.tail:
                    found.add(unit.last)
            self._framing = frozenset(found)
        return self._framing

    def nonblank(self, first: int, last: int) -> int:
        return self._nonblank[last + 1] - self._nonblank[first]

    def whole(self, moving: Iterable[int]) -> frozenset[int]:
        """``moving`` with the lines that make every unit it touches whole or untouched: every fence
        it touches, and every framed unit whose framing it holds or whose content it holds entirely
        (its framing then goes along), innermost first. Blank lines in ``moving`` stay in it."""
        key = moving if isinstance(moving, frozenset) else frozenset(moving)
        found = self._wholes.get(key)
        if found is None:
            if len(self._wholes) >= _WHOLES_KEPT:
                self._wholes.clear()
            found = self._wholes[key] = self._close(key)
        return found

    def _close(self, moving: frozenset[int]) -> frozenset[int]:
        touched = sorted(i for i in moving if 0 <= i < self.line_count and self.nonblank(i, i))
        if not touched:
            return moving
        taken: list[tuple[int, int]] = []

        def holds(first: int, last: int) -> bool:
            at = bisect_left(touched, first)
            return at < len(touched) and touched[at] <= last

        def close(unit: Unit) -> int:
            """The non-blank lines of ``unit`` moving once it is made whole."""
            if not holds(unit.first, unit.last):
                return 0
            if unit.kind == LINE:
                return 1
            size = self.nonblank(unit.first, unit.last)
            if unit.kind in ATOMIC:
                taken.append((unit.first, unit.last))
                return size
            content = sum(close(child) for child in unit.children)
            if unit.kind == RUN:
                if content == size - 1:  # all it heads: the opening line goes along
                    taken.append((unit.first, unit.last))
                    return size
                return content + holds(unit.first, unit.first)
            framing = (unit.head and holds(unit.first, unit.first)) or (unit.tail and holds(unit.last, unit.last))
            if unit.kind in FRAMED and (framing or content == size - unit.head - unit.tail):
                taken.append((unit.first, unit.last))
                return size
            return content

        for root in self.roots:
            close(root)
        if not taken:
            return moving
        whole = set(moving)
        for first, last in taken:
            whole.update(range(first, last + 1))
        return frozenset(whole)

    def torn(self, moving: Iterable[int]) -> list[Unit]:
        """The units ``moving`` tears: a run of code in part, a framed unit whose framing moves without all of
        its content or stays without any of it (what :meth:`whole` leaves none of)."""
        lines = {i for i in moving if 0 <= i < self.line_count and self.nonblank(i, i)}
        torn = []
        for unit in self.units():
            inside = [i for i in range(unit.first, unit.last + 1) if self.nonblank(i, i)]
            held = [i for i in inside if i in lines]
            if not held or len(held) == len(inside):
                continue
            if unit.kind in ATOMIC:
                torn.append(unit)
            elif unit.kind == RUN:
                if unit.first not in lines and all(i in lines for i in inside if i != unit.first):
                    torn.append(unit)  # what it heads moved without it
            elif unit.kind in FRAMED:
                framing = {unit.first} if unit.head else set()
                framing |= {unit.last} if unit.tail else set()
                content = [i for i in inside if i not in framing]
                if framing & lines or all(i in lines for i in content):
                    torn.append(unit)
        return torn


class _Parser:
    """One pass over a text's lines: fences and elements matched first (elements nested by a stack,
    none across a fence's bounds), then each range of lines read into units."""

    def __init__(self, reads: Sequence[_Line]) -> None:
        self.reads = reads
        self.ends: dict[int, tuple[str, int]] = {}  # opening line -> (kind, closing line)
        self._match()

    def _match(self) -> None:
        reads = self.reads
        closers: dict[str, list[int]] = {}
        sizes: dict[int, int] = {}
        for index, read in enumerate(reads):
            if read.uniform is not None:
                closers.setdefault(read.uniform[0], []).append(index)
                sizes[index] = read.uniform[1]
        opened: list[tuple[str, int]] = []
        index = 0
        while index < len(reads):
            read = reads[index]
            if read.fence is not None:
                char, size = read.fence
                candidates = closers.get(char, [])
                later = candidates[bisect_left(candidates, index + 1) :]
                close = next((c for c in later if sizes[c] >= size), None)
                if close is not None:
                    self.ends[index] = (FENCE, close)
                    inside: list[tuple[str, int]] = []
                    for inner in range(index + 1, close):
                        self._tag(inner, inside)
                    index = close + 1
                    continue
            self._tag(index, opened)
            index += 1

    def _tag(self, index: int, opened: list[tuple[str, int]]) -> None:
        read = self.reads[index]
        if read.close is not None and read.open is None:
            for depth in range(len(opened) - 1, -1, -1):
                if opened[depth][0] == read.close:
                    self.ends[opened[depth][1]] = (ELEMENT, index)
                    del opened[depth:]
                    break
        if read.open is not None:
            opened.append((read.open, index))

    def parse(self) -> tuple[Unit, ...]:
        return tuple(self._range(0, len(self.reads)))

    def _range(self, start: int, end: int, code: bool = False) -> list[Unit]:
        """The units of lines ``[start, end)``: blocks between blank lines and delimited units, a
        label ending its paragraph joined to the unit after it, headings folded into sections
        (``code``: inside a fence, where a block between blank lines is one unit of code)."""
        reads, ends = self.reads, self.ends
        units: list[Unit] = []
        introducing: int | None = None  # a label waiting for the unit it introduces
        index = start
        while index < end:
            if reads[index].blank:
                index += 1
                continue
            delimited = ends.get(index)
            if delimited is not None and delimited[1] < end:
                kind, close = delimited
                if kind == FENCE:
                    inner = tuple(self._range(index + 1, close, code=True))
                    found = [Unit(index, close, FENCE, inner, head=True, tail=True)]
                else:
                    inner = tuple(self._range(index + 1, close))
                    found = [Unit(index, close, ELEMENT, inner, head=True, tail=close > index)]
                index = close + 1
            else:
                stop = index
                while stop < end and not reads[stop].blank and (stop == index or stop not in ends):
                    stop += 1
                found = [Unit(index, stop - 1, CODE)] if code else self._run(self._block(index, stop))
                index = stop
            if introducing is not None and found[0].kind != SECTION and not reads[found[0].first].heading:
                label = units.pop()
                first = found.pop(0)
                found.insert(0, Unit(label.first, first.last, GROUP, (first,), head=True))
            units.extend(found)
            last = units[-1]
            introducing = last.first if last.kind == LINE and reads[last.first].label else None
        return self._sections(units)

    def _run(self, units: list[Unit]) -> list[Unit]:
        """A paragraph's units, as a run where a ``key: value`` line opens it with more after it."""
        if len(units) < 2 or units[0].kind != LINE:
            return units
        read = self.reads[units[0].first]
        if not read.pair or read.label or read.item or read.heading:
            return units
        return [Unit(units[0].first, units[-1].last, RUN, tuple(units[1:]), head=True)]

    def _block(self, start: int, end: int, introduced: bool = False) -> list[Unit]:
        """The units of non-blank lines ``[start, end)`` (``introduced``: what a label introduces,
        where a run of plain lines is one listing)."""
        reads = self.reads
        units: list[Unit] = []
        index = start
        waiting: int | None = None  # a label with nothing of its own: it introduces the unit after it
        while index < end:
            read = reads[index]
            if waiting is not None and units[-1].first > waiting:
                _introduce(units)
                waiting = None
            if read.label and not read.item and index + 1 < end:
                stop = index + 1
                while stop < end and not (
                    reads[stop].indent <= read.indent and (reads[stop].label or reads[stop].heading)
                ):
                    stop += 1
                if stop == index + 1:
                    # Another label or a heading right after it: it introduces that (a heading's
                    # section is joined to it once sections are made). Of a run of such labels,
                    # only the last introduces what follows: one level, however long the run.
                    units.append(Unit(index, index, LINE))
                    waiting = None if reads[stop].heading else index
                    index = stop
                    continue
                inner = tuple(self._block(index + 1, stop, introduced=True))
                units.append(Unit(index, stop - 1, GROUP, inner, head=True))
                index = stop
            elif read.item:
                stop = index + 1
                while stop < end and reads[stop].indent > read.indent:
                    stop += 1
                inner = tuple(self._block(index + 1, stop))
                units.append(Unit(index, stop - 1, ITEM, inner, head=True) if inner else Unit(index, index, LINE))
                index = stop
            elif introduced and _plain(read):
                stop = index + 1
                while stop < end and _plain(reads[stop]):
                    stop += 1
                units.append(Unit(index, stop - 1, LISTING) if stop > index + 1 else Unit(index, index, LINE))
                index = stop
            else:
                units.append(Unit(index, index, LINE))
                index += 1
        if waiting is not None and units[-1].first > waiting:
            _introduce(units)
        return units

    def _sections(self, units: list[Unit]) -> list[Unit]:
        """Each heading with the units after it up to a heading of its level or above."""
        reads = self.reads
        out: list[Unit] = []
        index = 0
        while index < len(units):
            unit = units[index]
            level = reads[unit.first].heading if unit.kind == LINE else 0
            if not level:
                out.append(unit)
                index += 1
                continue
            stop = index + 1
            while stop < len(units) and not (
                units[stop].kind == LINE and 0 < reads[units[stop].first].heading <= level
            ):
                stop += 1
            inner = tuple(self._sections(units[index + 1 : stop]))
            out.append(Unit(unit.first, units[stop - 1].last, SECTION, inner, head=True) if inner else unit)
            if len(out) > 1 and out[-2].kind == LINE and reads[out[-2].first].label:
                _introduce(out)  # ``Context:`` then a document that opens with a heading
            index = stop
        return out


def _introduce(units: list[Unit]) -> None:
    """The label before the last unit made the framing of a group around that unit."""
    label, first = units.pop(-2), units.pop()
    units.append(Unit(label.first, first.last, GROUP, (first,), head=True))


def _plain(read: _Line) -> bool:
    return not (read.label or read.item or read.pair or read.heading)


def _starts(lines: list[str]) -> list[int]:
    """Where each line starts in the text, and one past its end (in C: a prompt is re-read whole
    when a clock in it ticks)."""
    return [0, *map(add, accumulate(map(len, lines)), count(1))]


# Texts seen before, by digest: a system prompt re-sent is a lookup.
_TREES: LRUCache[int, Units] = LRUCache(256)
# The texts parsed last, with their trees: a text that differs from one of them in a few lines that
# read alike (a clock ticking, a count, a date: a value in a line) has its tree.
_RECENT: deque[tuple[str, Units]] = deque(maxlen=8)
# Lines a text may differ in from a recent one and still take its tree (past them, parsed anew).
_ALIKE_LINES = 8


def units_of(text: str) -> Units:
    """The unit tree of ``text`` (kept by the text's digest; a text that differs from one parsed
    lately only in values within its lines takes that one's tree, without a pass in Python over
    its lines)."""
    key = xxhash.xxh3_128_intdigest(text.encode("utf-8", "surrogatepass"))
    found = _TREES.get(key)
    if found is not None:
        return found
    found = _within_a_line(text)
    if found is None:
        lines = text.split("\n")
        for recent, tree in reversed(_RECENT):
            if tree.line_count == len(lines) and _alike(recent.split("\n"), lines):
                found = Units(None, lines, like=tree)
                break
        else:
            found = Units(None, lines)
    _TREES[key] = found
    _RECENT.append((text, found))
    return found


def _within_a_line(text: str) -> Units | None:
    """The tree of a recent text as long as ``text`` whose characters differ from it within one
    line only, that line read alike (a clock that ticked): found with string operations in C, the
    text not split into lines."""
    for recent, tree in reversed(_RECENT):
        if len(recent) != len(text):
            continue
        first = shared_length(recent, text)
        last = len(text) - 1 - shared_length(recent[::-1], text[::-1])
        if "\n" in text[first : last + 1] or "\n" in recent[first : last + 1]:
            continue
        start = text.rfind("\n", 0, first) + 1
        end = text.find("\n", last)
        end = len(text) if end < 0 else end
        if _read(text[start:end]).reading == _read(recent[start:end]).reading:
            return Units.same_lines(tree)
    return None


def _alike(old: list[str], new: list[str]) -> bool:
    """Whether two texts of as many lines differ in at most ``_ALIKE_LINES`` lines, each read alike
    by the parser. The differing lines are found by halving slices compared in C."""
    differing: list[int] = []
    pending = [(0, len(new))]
    while pending:
        start, end = pending.pop()
        if old[start:end] == new[start:end]:
            continue
        if end - start == 1:
            differing.append(start)
            if len(differing) > _ALIKE_LINES:
                return False
            continue
        middle = (start + end) // 2
        pending += ((middle, end), (start, middle))
    return all(_read(old[i]).reading == _read(new[i]).reading for i in differing)


def whole_units(text: str, moving: Iterable[int]) -> frozenset[int]:
    """:meth:`Units.whole` on ``text``'s tree."""
    return units_of(text).whole(moving)
