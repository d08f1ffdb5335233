"""What relocation derives from a system prompt's text, kept so that a text seen before costs a lookup.

Relocation reads a system prompt line by line: which lines the detectors find, the lines' hashes
for learned volatility, the text's blocks (fences, tags, introduced lists) and its weak lines, where
each line starts. All of that is a pure function of the text and the detector set, so it is kept:

- per distinct line, its :class:`LineFacts` (hash, line-local detections, how the environment
  detector and the block finder read the line), by the line's hash salted per tenant;
- per text, its :class:`TextFacts` (offsets, hashes and line indices, never text) once the text
  was seen twice, by a digest seeded per tenant: a text sent once (the worst case, a new system
  prompt on every request) costs no memory;
- per place (tenant, app, system message, text part), the last text read whole and the lines that
  differed between its texts (*holes*: a line with the current time, a user's name). A text that
  differs from it only in those lines is recognized by hashing the stretches between them, and its
  facts are the place's with only the holes read anew.

So the work a request costs grows with what is new in its system prompt, not with its length. The
outcome never depends on this memory (tests run the same traffic with and without it); caches are
bounded by lines held, and keyed per tenant so that no tenant's request is faster for another's.
"""

from __future__ import annotations

import contextlib
import os
import re
from array import array
from bisect import bisect_left, bisect_right, insort
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, islice
from operator import attrgetter, ne
from typing import Any

import orjson
import xxhash
from cachetools import LRUCache

from proxy.canon import relocate as rl
from proxy.canon import volatile as vo
from proxy.canon.learned import PromptLines, line_hash
from proxy.canon.volatile import Detector, Span, detect_environment_blocks
from proxy.recent import RecentSet

# Places keep at most this many holes (and a quarter of their lines): beyond, the text changes
# too much in too many places for stretches to be worth checking.
MAX_HOLES = 16
# Memo entries of one text's facts (results per set of moving lines, ...): a text meets few.
MAX_RESULTS_PER_TEXT = 32

_CHAR_CODES = {"`": 1, "~": 2}
_BLANK = vo._BLANK
_FACT = vo._FACT
_PATH = vo._PATH
_HEADER = vo._HEADER
_OTHER = vo._OTHER


def _name_hash(name: str) -> int:
    return xxhash.xxh3_64_intdigest(name.encode("utf-8", "surrogatepass"))


def _text_bytes(text: str) -> bytes:
    """An injective byte form of a text, cheap to make (orjson's JSON string; raw UTF-8 where orjson
    refuses a lone surrogate)."""
    try:
        return orjson.dumps(text)
    except TypeError:
        return b"\x00" + text.encode("utf-8", "surrogatepass")


def _utf8(text: str) -> bytes:
    """The text's UTF-8 bytes. Through orjson first, which keeps them with the string: the request's
    later serializations of it (the layout's digests, the body sent upstream) do not convert again."""
    with contextlib.suppress(TypeError):  # a lone surrogate: no bytes kept
        orjson.dumps(text)
    return text.encode("utf-8", "surrogatepass")


class LineFacts:
    """What relocation reads from one line, apart from the text itself."""

    __slots__ = (
        "blank",
        "close_tag",
        "context",
        "env_close",
        "env_tag",
        "fence",
        "hash",
        "introduces",
        "kind",
        "local",
        "open_tag",
        "structural",
        "uniform",
        "weak",
    )

    def __init__(self, line: str, local_detectors: Sequence[Detector]) -> None:
        stripped = line.strip()
        self.blank = not stripped
        self.hash = 0 if self.blank else line_hash(line)
        # volatile.detect_spans: line-local detections of a non-blank line.
        self.local = () if self.blank else vo._scan_line(line, list(local_detectors))
        # volatile's environment detector.
        self.kind = vo._line_kind(line)
        tag = vo._TAG_OPEN.match(line) if "<" in line else None
        self.env_tag = _name_hash(f"</{tag.group(1)}>") if tag else None  # the closing line it wants
        self.env_close = _name_hash(stripped) if stripped.startswith("</") else None
        # Holds a marker of volatile's <context> blocks (which span lines, but no marker does).
        self.context = "<context>" in line or "</context>" in line
        self.weak: bool | None = None  # relocate's block facts: read when blocks are asked for

    def read_blocks(self, line: str) -> None:
        """The facts ``relocate.text_blocks``, ``close_blocks`` and ``weak_lines`` read."""
        stripped = line.strip()
        fence = rl._FENCE.match(line)
        self.fence = (_CHAR_CODES[fence.group(1)[0]], len(fence.group(1))) if fence else None
        code = _CHAR_CODES.get(stripped[:1])
        self.uniform = (code, len(stripped)) if code and stripped == stripped[0] * len(stripped) else None
        close_tag = rl._CLOSE_TAG.match(line)
        self.close_tag = _name_hash(close_tag.group(1)) if close_tag else None
        open_tag = rl._OPEN_TAG.match(line)
        self.open_tag = _name_hash(open_tag.group(1)) if open_tag and not line.rstrip().endswith("/>") else None
        self.structural = bool(fence or open_tag)
        self.introduces = rl._introduces(line)
        self.weak = self.blank or _ALNUM.search(line) is None or bool(close_tag)

    def same_blocks(self, other: LineFacts) -> bool:
        """Whether the two lines count alike in ``relocate.text_blocks``."""
        return (
            self.blank == other.blank
            and self.fence == other.fence
            and self.uniform == other.uniform
            and self.close_tag == other.close_tag
            and self.open_tag == other.open_tag
            and self.introduces == other.introduces
        )

    def same_environment(self, other: LineFacts) -> bool:
        """Whether the two lines count alike in the environment detector (a fact's text counts too)."""
        return self.kind == other.kind != _FACT and self.env_tag == other.env_tag and self.env_close == other.env_close

    def same_shape(self, other: LineFacts, line: str) -> bool:
        """Whether a text holding this line (``line``) instead of ``other``, at the same length, reads
        alike everywhere but in the line's hash: the same line-local detections at the same offsets,
        the same environment reading (not a fact, whose text counts) and no ``<context>`` marker; the
        same block facts where ``other``'s were read (this line's are read for that)."""
        if not (
            self.local == other.local
            and self.blank == other.blank
            and self.same_environment(other)
            and not self.context
            and not other.context
        ):
            return False
        if other.weak is None:
            return True
        if self.weak is None:
            self.read_blocks(line)
        return self.weak == other.weak and self.structural == other.structural and self.same_blocks(other)


# A character ``str.isalnum`` holds for (``\w`` is those and the underscore).
_ALNUM = re.compile(r"[^\W_]")

# What a text's facts derive from its lines' shapes and positions alone, never from their hashes or
# text (``TextFacts.reshaped`` carries them): the blocks, the environment's runs, and the results
# relocation keeps under these names (``cached`` keys are tuples that start with the name).
SHAPE_RESULTS = frozenset({"environment", "plan", "touched"})

# The line indices a text's facts keep, by what each line is; the block ones once blocks are asked for.
_INDEXED: dict[str, Callable[[LineFacts], Any]] = {
    "blank": attrgetter("blank"),
    "local": attrgetter("local"),
    "fact": lambda f: f.kind == _FACT,
    "env_tag": lambda f: f.env_tag is not None,
    "env_close": lambda f: f.env_close is not None,
}
_INDEXED_BLOCKS: dict[str, Callable[[LineFacts], Any]] = {
    "fence": attrgetter("fence"),
    "uniform": attrgetter("uniform"),
    "tag": lambda f: f.close_tag is not None or f.open_tag is not None,
    "introduces": attrgetter("introduces"),
}


class TextFacts:
    """One text's facts: its lines' facts, hashes and offsets, and what relocation derived from them.

    Read whole (``base`` None), or as a place's text with some of its lines (``holes``) replaced.
    """

    __slots__ = (
        "base",
        "deltas",
        "detected",
        "facts",
        "hashes",
        "holes",
        "index",
        "keys",
        "memo",
        "n",
        "spans",
    )

    def __init__(
        self,
        keys: array[int],
        facts: list[LineFacts],
        starts: array[int],
        hashes: array[int] | None = None,
        base: TextFacts | None = None,
        holes: tuple[int, ...] = (),
        deltas: tuple[int, ...] = (),
    ) -> None:
        self.n = len(facts)
        self.keys = keys  # each line's own hash, salted (line identity)
        self.facts = facts
        self.hashes: array[int] = hashes if hashes is not None else array("Q", map(attrgetter("hash"), facts))
        self.base = base
        self.holes = holes  # lines read anew (into the base's text)
        self.deltas = deltas  # cumulative length change after each hole
        self.memo: dict[Any, Any] = {"starts": starts}
        # volatile.detect_spans of the text, and the lines they touch (see prepare).
        self.spans: list[Span] = []
        self.detected: frozenset[int] = frozenset()
        if base is None:
            self.index = {name: list(compress(range(self.n), map(test, facts))) for name, test in _INDEXED.items()}
        else:
            self.index = _patched_index(base, facts, holes, _INDEXED)

    def read_blocks(self, text: str) -> None:
        """Have every line's block facts and their indices (``LineFacts.read_blocks``)."""
        if "fence" in self.index:
            return
        base = self.base
        facts = self.facts
        if base is not None and "fence" in base.index:
            for hole in self.holes:
                if facts[hole].weak is None:
                    facts[hole].read_blocks(self.line(text, hole))
            self.index.update(_patched_index(base, facts, self.holes, _INDEXED_BLOCKS))
            return
        for index in compress(range(self.n), map(_unread, facts)):
            facts[index].read_blocks(self.line(text, index))
        self.index.update(
            {name: list(compress(range(self.n), map(test, facts))) for name, test in _INDEXED_BLOCKS.items()}
        )

    def prepare(self, text: str, detectors: Sequence[Detector]) -> TextFacts:
        self.spans = self.find_spans(text, detectors)
        self.detected = frozenset(self.lines_touched(self.spans))
        return self

    def reshaped(self, keys: array[int], facts: list[LineFacts], hashes: array[int]) -> TextFacts:
        """These facts for the same place's text with other lines of the same shape in the holes
        (:meth:`LineFacts.same_shape`, each hole the same length): the spans, the line indices and what
        was derived from shapes alone are these; what hashes or text decide is derived afresh."""
        assert self.base is not None
        twin = TextFacts.__new__(TextFacts)
        twin.n, twin.keys, twin.facts, twin.hashes = self.n, keys, facts, hashes
        twin.base, twin.holes, twin.deltas = self.base, self.holes, self.deltas
        twin.memo = {
            key: value
            for key, value in self.memo.items()
            if key == "starts" or (key if isinstance(key, str) else key[0]) in SHAPE_RESULTS
        }
        twin.spans, twin.detected, twin.index = self.spans, self.detected, dict(self.index)
        return twin

    # -- offsets ----------------------------------------------------------------------------

    def start(self, line: int) -> int:
        """Offset of a line's first character (``n``: one past the text's end, as if a newline followed)."""
        starts: array[int] = (self.base or self).memo["starts"]
        if not self.holes:
            return starts[line]
        before = bisect_left(self.holes, line)
        return starts[line] + (self.deltas[before - 1] if before else 0)

    def line_of(self, offset: int) -> int:
        """The line holding ``offset``: the last line starting at or before it (``relocate._line_of``)."""
        starts: array[int] = (self.base or self).memo["starts"]
        shift = 0
        for number, hole in enumerate(self.holes):
            if offset < starts[hole] + shift:
                break
            if offset < starts[hole + 1] + self.deltas[number]:
                return hole
            shift = self.deltas[number]
        return max(0, min(self.n - 1, bisect_right(starts, offset - shift) - 1))

    def line(self, text: str, index: int) -> str:
        return text[self.start(index) : self.start(index + 1) - 1]

    def lines_touched(self, spans: Iterable[Span]) -> set[int]:
        touched: set[int] = set()
        for span in spans:
            first = self.line_of(span.start)
            last = self.line_of(max(span.start, span.end - 1))
            touched.update(range(first, last + 1))
        return touched

    def nonblank(self, first: int, end: int) -> int:
        """Non-blank lines in ``[first, end)``."""
        blank = self.index["blank"]
        return (end - first) - (bisect_left(blank, end) - bisect_left(blank, first))

    def cached(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``, once per ``key`` for these facts (what relocation derives from a set of lines)."""
        found = self.memo.get(key)
        if found is None:
            found = self.remember(key, compute())
        return found

    def remember(self, key: Any, value: Any) -> Any:
        if len(self.memo) > MAX_RESULTS_PER_TEXT:
            starts = self.memo["starts"]
            self.memo.clear()
            self.memo["starts"] = starts
        self.memo[key] = value
        return value

    def holes_within(self, lines: set[int] | frozenset[int]) -> bool:
        return all(h in lines for h in self.holes)

    # -- what relocation derives ---------------------------------------------------------------

    def find_spans(self, text: str, detectors: Sequence[Detector]) -> list[Span]:
        """``volatile.detect_spans(text, detectors)``."""
        spans: list[Span] = []
        for detector in detectors:
            if getattr(detector, "line_local", False):
                continue
            if detector is detect_environment_blocks:
                spans.extend(self.environment_spans(text))
            elif detector is vo.detect_context_blocks:
                spans.extend(self._context_spans(text))
            else:
                spans.extend(detector(text))
        for index in self.index["local"]:
            offset = self.start(index)
            spans.extend(Span(offset + s, offset + e, kind) for s, e, kind in self.facts[index].local)
        return sorted(spans)

    def _context_spans(self, text: str) -> list[Span]:
        """``volatile.detect_context_blocks(text)``: the base's blocks, moved by the holes' lengths, when
        no hole holds a marker (the markers, hence the blocks, are where they were)."""
        base = self.base
        if base is None or "context" not in base.memo:
            found = list(vo.detect_context_blocks(text))
            self.memo["context"] = found
            return found
        if any(self.facts[h].context or base.facts[h].context for h in self.holes):
            return list(vo.detect_context_blocks(text))
        return [
            Span(self._moved(span.start), self._moved(span.end - 1) + 1, span.kind) for span in base.memo["context"]
        ]

    def _moved(self, offset: int) -> int:
        """An offset into the base's text (on a line that is no hole), in this text."""
        assert self.base is not None
        before = bisect_left(self.holes, self.base.line_of(offset))
        return offset + (self.deltas[before - 1] if before else 0)

    def environment_spans(self, text: str) -> list[Span]:
        """``volatile.detect_environment_blocks(text)``."""
        if ":" not in text and "</" not in text:
            return []
        runs = self._environment_runs(text)
        return [Span(self.start(first), self.start(last + 1) - 1, "environment") for first, last in runs]

    def _environment_runs(self, text: str) -> list[tuple[int, int]]:
        found = self.memo.get("environment")
        if found is None:
            base = self.base
            if (
                base is not None
                and "environment" in base.memo
                and all(base.facts[h].same_environment(self.facts[h]) for h in self.holes)
            ):
                found = base.memo["environment"]
            else:
                found = _environment_runs(self, text)
            self.memo["environment"] = found
        return found

    def weak(self, text: str) -> set[int]:
        """``relocate.weak_lines(lines)``."""
        found = self.memo.get("weak")
        if found is None:
            self.read_blocks(text)
            counts = Counter(self.keys)
            repeated = compress(range(self.n), map((1).__lt__, map(counts.__getitem__, self.keys)))
            found = self.memo["weak"] = set(compress(range(self.n), map(attrgetter("weak"), self.facts)))
            found.update(repeated)
        return found

    def learned_input(self, detected: frozenset[int]) -> PromptLines:
        """The prompt learned volatility observes: the hashes of the lines not detected."""
        key = ("learned", detected)
        found = self.memo.get(key)
        if found is None:
            base = self.base
            if base is not None and self.holes_within(detected):
                found = base.memo.get(key) or base.remember(key, _learned_input(base.hashes, detected))
            else:
                found = _learned_input(self.hashes, detected)
            self.remember(key, found)
        return found

    def skeleton(self, text: str, detected: frozenset[int], learned: frozenset[int]) -> int:
        """``relocation._skeleton(lines, detected, learned)``."""
        key = ("skeleton", detected, learned)
        found = self.memo.get(key)
        if found is None:
            base = self.base
            if base is not None and self.holes_within(detected | learned):
                # The lines around the candidates are the base's: so is the skeleton.
                found = base.memo.get(key)
                if found is None:
                    found = base.remember(key, _skeleton(self, text, detected, learned))
            else:
                found = _skeleton(self, text, detected, learned)
            self.remember(key, found)
        return found

    def line_positions(self, hashed: int) -> list[int]:
        """The non-blank lines with this hash, in order."""
        by_hash = self.memo.get("by_hash")
        if by_hash is None:
            by_hash = {}
            for index, (value, line) in enumerate(zip(self.hashes, self.facts, strict=True)):
                if not line.blank:
                    by_hash.setdefault(value, []).append(index)
            self.memo["by_hash"] = by_hash
        return by_hash.get(hashed, [])

    def holds(self, hashed: int) -> bool:
        """Whether a non-blank line has this hash."""
        return self.holder()(hashed)

    def holder(self) -> Callable[[int], bool]:
        """:meth:`holds`, as a function made once per text: a relocation asks once per block
        remembered at a position, up to sixteen."""
        found: Callable[[int], bool] | None = self.memo.get("holder")
        if found is not None:
            return found
        base = self.base
        if base is None:
            found = self.hash_set().__contains__
        else:
            # The holes' own lines, and the base's lines that were only in the holes (gone here).
            holes, facts, was = self.holes, self.facts, base.facts
            present = frozenset(facts[h].hash for h in holes if not facts[h].blank)
            replaced = {base.hashes[h] for h in holes if not was[h].blank}
            gone = frozenset(g for g in replaced if all(p in holes for p in base.line_positions(g)))
            kept = base.hash_set()

            def found(hashed: int) -> bool:
                return hashed in present or (hashed not in gone and hashed in kept)

        self.memo["holder"] = found
        return found

    def hash_set(self) -> frozenset[int]:
        """The hashes of the non-blank lines."""
        found = self.memo.get("hash_set")
        if found is None:
            hashes = set(self.hashes)
            if 0 in hashes and self.hashes.count(0) == len(self.index["blank"]):
                hashes.discard(0)  # only blank lines hash as 0 here
            found = self.memo["hash_set"] = frozenset(hashes)
        return found


def _unread(line: LineFacts) -> bool:
    return line.weak is None


def _patched_index(
    base: TextFacts, facts: list[LineFacts], holes: tuple[int, ...], tests: dict[str, Callable[[LineFacts], Any]]
) -> dict[str, list[int]]:
    index: dict[str, list[int]] = {}
    for name, test in tests.items():
        found = base.index[name]
        copied = False
        for hole in holes:
            was, now = bool(test(base.facts[hole])), bool(test(facts[hole]))
            if was == now:
                continue
            if not copied:
                found, copied = list(found), True
            if was:
                del found[bisect_left(found, hole)]
            else:
                insort(found, hole)
        index[name] = found
    return index


def _learned_input(hashes: array[int], detected: frozenset[int]) -> PromptLines:
    """``relocation._without(lines, detected)`` as learned volatility hashes it."""
    if not detected:
        return PromptLines(hashes)
    kept = array("Q", hashes)
    for index in sorted(detected, reverse=True):
        if index < len(kept):
            del kept[index]
    return PromptLines(kept)


def _environment_runs(tf: TextFacts, text: str) -> list[tuple[int, int]]:
    """``volatile._environment_spans`` in lines (each with the header introducing it), from the lines'
    kinds: work for the facts, paths and tags only."""
    facts = tf.facts
    blocks = _environment_tags(tf) + _facts_runs(tf, text)
    blocks.sort()
    merged: list[tuple[int, int]] = []
    for first, last in blocks:
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    out = []
    for first, last in merged:
        if first > 0 and facts[first - 1].kind == _HEADER:
            first -= 1
        out.append((first, last))
    return out


def _environment_tags(tf: TextFacts) -> list[tuple[int, int]]:
    facts, n = tf.facts, tf.n
    tags, closes = tf.index["env_tag"], tf.index["env_close"]
    found: list[tuple[int, int]] = []
    for position, index in enumerate(tags):
        closing = facts[index].env_tag
        stop = min(n, index + vo._MAX_BLOCK_LINES)
        if position + 1 < len(tags):
            stop = min(stop, tags[position + 1])  # a nested block: judged on its own
        for end in islice(closes, bisect_right(closes, index), None):
            if end >= stop:
                break
            if facts[end].env_close == closing:
                inner = [f.kind for f in facts[index + 1 : end] if f.kind != _BLANK]
                count_facts = inner.count(_FACT)
                paths = inner.count(_PATH)
                if inner and (count_facts or paths >= 3) and (count_facts + paths) >= vo._ENV_BLOCK_SHARE * len(inner):
                    found.append((index, end))
                break
    return found


def _facts_runs(tf: TextFacts, text: str) -> list[tuple[int, int]]:
    facts, n = tf.facts, tf.n
    found: list[tuple[int, int]] = []
    resume = 0
    for index in tf.index["fact"]:
        if index < resume:
            continue
        first = last = index
        seen = {tf.line(text, index).strip()}
        cursor = index + 1
        under_header = False
        while cursor < n:
            kind = facts[cursor].kind
            if kind == _FACT or (kind in vo._UNDER_HEADER and under_header):
                if kind == _FACT:
                    seen.add(tf.line(text, cursor).strip())
                last = cursor
            elif kind == _HEADER:
                following = _OTHER
                for ahead in range(cursor + 1, n):
                    if facts[ahead].kind != _BLANK:
                        following = facts[ahead].kind
                        break
                if following != _FACT and following not in vo._UNDER_HEADER:
                    break
                under_header = True
                seen.add(f"\x00header {cursor}")
                last = cursor
            elif kind == _BLANK:
                if cursor + 1 < n and facts[cursor + 1].kind == _BLANK:
                    break
                under_header = False
            else:
                break
            cursor += 1
        if len(seen) >= 2:
            found.append((first, last))
        resume = cursor
    return found


def _skeleton(tf: TextFacts, text: str, detected: frozenset[int], learned: frozenset[int]) -> int:
    """The text around the candidates (``relocation._skeleton``), built from stretches of the text."""
    pieces: list[str] = []
    previous = ""
    blank = tf.index["blank"]

    def stretch(first: int, end: int) -> None:
        """The non-blank lines of ``[first, end)``, each with its newline."""
        nonlocal previous
        cursor = first
        for gap in islice(blank, bisect_left(blank, first), None):
            if gap >= end:
                break
            if gap > cursor:
                pieces.append(text[tf.start(cursor) : tf.start(gap)])
                previous = ""
            cursor = gap + 1
        if cursor < end:
            pieces.append(text[tf.start(cursor) : tf.start(end) - 1])
            pieces.append("\n")
            previous = ""

    cursor = 0
    for index in sorted(detected | learned):
        if index >= tf.n:
            continue
        stretch(cursor, index)
        cursor = index + 1
        if tf.facts[index].blank:
            continue
        mark = "\x00d" if index in detected else "\x00l"
        if mark != previous:
            pieces.append(mark + "\n")
            previous = mark
    stretch(cursor, tf.n)
    return xxhash.xxh3_64_intdigest("".join(pieces).encode("utf-8", "surrogatepass"))


# -- relocate's line functions on facts ------------------------------------------------------------


def runs(tf: TextFacts, indices: list[int], *, bridge_blank: bool) -> list[tuple[int, int]]:
    """``relocate.runs``."""
    found: list[tuple[int, int]] = []
    for index in indices:
        if found:
            previous = found[-1][1]
            if index == previous + 1 or (bridge_blank and tf.nonblank(previous + 1, index) == 0):
                found[-1] = (found[-1][0], index)
                continue
        found.append((index, index))
    return found


def widen(tf: TextFacts, varying: set[int], weak: set[int]) -> set[int]:
    """``relocate.widen``."""
    facts = tf.facts
    widened = set(varying)
    for index in sorted(varying):
        low = index
        while low - 1 >= 0 and low - 1 in weak and low - 1 not in widened:
            low -= 1
        high = index
        while high + 1 < tf.n and high + 1 in weak and high + 1 not in widened:
            high += 1
        while low < index and facts[low].blank:
            low += 1
        while high > index and facts[high].blank:
            high -= 1
        widened.update(range(low, high + 1))
    return widened


def bridge_blanks(tf: TextFacts, moving: set[int]) -> set[int]:
    """``relocate.bridge_blanks``."""
    bridged = set(moving)
    for first, last in runs(tf, sorted(moving), bridge_blank=True):
        bridged.update(range(first, last + 1))
    return bridged


def already_at_end(tf: TextFacts, volatile: set[int]) -> bool:
    """``relocate.already_at_end``."""
    if not volatile:
        return True
    facts = tf.facts
    return all(i in volatile or facts[i].blank for i in range(min(volatile), tf.n))


def partition(tf: TextFacts, text: str, volatile: set[int]) -> tuple[str, str]:
    """``relocate.partition_lines``, cut from the text in stretches."""
    return cut(tf, text, plan(tf, volatile))


# Which lines stay and which move, as runs (first, last), or None: everything moves.
Plan = tuple[list[tuple[int, int]], list[tuple[int, int]]] | None


def cut(tf: TextFacts, text: str, planned: Plan) -> tuple[str, str]:
    if planned is None:
        return "", text
    stable, moved = planned
    return (
        "\n".join(text[tf.start(a) : tf.start(b + 1) - 1] for a, b in stable),
        "\n".join(text[tf.start(a) : tf.start(b + 1) - 1] for a, b in moved),
    )


def plan(tf: TextFacts, volatile: set[int]) -> Plan:
    """``relocate.partition_lines`` in runs of lines."""
    facts, n = tf.facts, tf.n
    moving = set(volatile)
    for first, last in runs(tf, sorted(volatile), bridge_blank=False):
        before_blank = first == 0 or facts[first - 1].blank
        after_blank = last == n - 1 or facts[last + 1].blank
        if not (before_blank and after_blank):
            continue
        if last + 1 < n and facts[last + 1].blank and last + 1 not in moving:
            moving.add(last + 1)
        elif first > 0 and facts[first - 1].blank and first - 1 not in moving:
            moving.add(first - 1)
    moving_nonblank = sum(1 for i in moving if i < n and not facts[i].blank)
    if tf.nonblank(0, n) - moving_nonblank == 0:
        return None
    moved = runs(tf, sorted(i for i in moving if i < n), bridge_blank=False)
    stable: list[tuple[int, int]] = []
    cursor = 0
    for first, last in moved:
        if first > cursor:
            stable.append((cursor, first - 1))
        cursor = last + 1
    if cursor < n:
        stable.append((cursor, n - 1))
    return stable, moved


def line_ids(tf: TextFacts, moving: set[int], part: int) -> list[tuple[int, int]]:
    """``relocation._line_ids``."""
    facts, hashes = tf.facts, tf.hashes
    return [(part, hashes[i]) for i in sorted(moving) if not facts[i].blank]


# -- the memory ------------------------------------------------------------------------------------


class _Place:
    """The last text of a place read whole, its holes, and the stretches of its UTF-8 bytes around
    them as (length, digest): the first up to the first hole, then from the newline ending each hole
    to the next hole (the last to the end of the text)."""

    __slots__ = ("facts", "filled", "holes", "seed", "stretches")

    def __init__(self, facts: TextFacts, text: str, holes: tuple[int, ...], seed: int) -> None:
        self.facts = facts
        self.holes = holes
        self.seed = seed
        # The last text filled in, by its holes' line keys: a conversation re-sends the same one.
        self.filled: tuple[tuple[int, ...], TextFacts] | None = None
        data = _utf8(text)
        raw = memoryview(data)
        self.stretches: list[tuple[int, int]] = []
        start = 0  # where the stretch begins
        cursor = line = 0  # the first byte of a line, and that line
        for hole in holes:
            while line < hole:
                cursor = data.find(b"\n", cursor) + 1
                line += 1
            self.stretches.append((cursor - start, self._digest(raw[start:cursor])))
            end = data.find(b"\n", cursor)
            start = len(data) if end < 0 else end
            cursor, line = start + 1, hole + 1
        self.stretches.append((len(data) - start, self._digest(raw[start:])))

    def _digest(self, raw: memoryview) -> int:
        return xxhash.xxh3_128_intdigest(raw, seed=self.seed)

    def fill(self, text: str) -> list[str] | None:
        """The holes' lines in ``text``, if it is this place's text but for them; else None."""
        data = _utf8(text)
        raw = memoryview(data)
        cursor = 0
        contents: list[str] = []
        last_line = self.facts.n - 1
        for number, (size, digest) in enumerate(self.stretches):
            end = cursor + size
            if end > len(raw) or self._digest(raw[cursor:end]) != digest:
                return None
            if number == len(self.holes):
                return contents if end == len(raw) else None
            newline = data.find(b"\n", end)
            if self.holes[number] == last_line:
                if newline >= 0:
                    return None
                newline = len(raw)
            elif newline < 0:
                return None
            contents.append(data[end:newline].decode("utf-8", "surrogatepass"))
            cursor = newline
        return None


def _facts_size(facts: TextFacts) -> int:
    return max(1, facts.n)


class TextMemo:
    """The long-lived memory (one per canonicalizer); :meth:`scope` gives one request's view of it."""

    def __init__(self, max_lines: int = 100_000, max_places: int = 4096) -> None:
        """``max_lines``: lines of the texts kept (each place's and those seen twice; a quarter as many
        distinct lines' facts)."""
        self.max_lines = max(1, max_lines // 4)
        self._lines: dict[int, LineFacts] = {}
        self._texts: LRUCache[int, TextFacts] = LRUCache(max(1, max_lines), getsizeof=_facts_size)
        self._seen: RecentSet[int] = RecentSet(16_384)
        self._places: LRUCache[tuple[int, str], _Place] = LRUCache(
            max(1, max_lines), getsizeof=lambda p: _facts_size(p.facts)
        )
        self._place_count = max_places
        self._salts: LRUCache[str, int] = LRUCache(16_384)
        self._detectors: tuple[Detector, ...] | None = None
        self._local: tuple[Detector, ...] = ()
        self.reshapes = False

    def scope(self, namespace: str, detectors: Sequence[Detector]) -> TextScope:
        detectors = tuple(detectors)
        if detectors != self._detectors:
            # Another detector set (a reload): what was read with the old one no longer holds.
            self._lines.clear()
            self._texts.clear()
            self._places.clear()
            self._seen = RecentSet(16_384)
            self._detectors = detectors
            self._local = tuple(d for d in detectors if getattr(d, "line_local", False))
            # Texts of the same shape read alike only where every detector reads lines (or is one
            # of the block detectors whose reading the shapes cover); a rule sees the whole text.
            self.reshapes = all(
                d in self._local or d is detect_environment_blocks or d is vo.detect_context_blocks for d in detectors
            )
        salt = self._salts.get(namespace)
        if salt is None:
            salt = self._salts[namespace] = int.from_bytes(os.urandom(8), "little") >> 1
        return TextScope(self, salt, detectors)

    def __len__(self) -> int:
        return len(self._lines) + int(self._texts.currsize) + int(self._places.currsize)

    # -- internals -----------------------------------------------------------------------------

    def line_facts(self, keys: Iterable[int], lines: Sequence[str]) -> list[LineFacts]:
        memo = self._lines
        found: list[LineFacts | None] = list(map(memo.get, keys))
        if None in found:
            keys = list(keys) if not isinstance(keys, list | array) else keys
            for index in compress(range(len(found)), map(_is_none, found)):
                facts = found[index] = LineFacts(lines[index], self._local)
                memo[keys[index]] = facts
            if len(memo) > self.max_lines:
                for key in list(islice(memo, len(memo) - self.max_lines + self.max_lines // 8)):
                    del memo[key]
        return found  # type: ignore[return-value]


def _is_none(value: object) -> bool:
    return value is None


def _same_shapes(filled: TextFacts, lines: list[LineFacts], contents: list[str]) -> bool:
    """Whether ``contents`` (read as ``lines``) in the holes read as ``filled``'s holes do: each the
    same length (so every offset is the same) and the same shape."""
    for number, (hole, line, content) in enumerate(zip(filled.holes, lines, contents, strict=True)):
        was = filled.deltas[number] - (filled.deltas[number - 1] if number else 0)
        length = filled.base.start(hole + 1) - 1 - filled.base.start(hole) + was  # type: ignore[union-attr]
        if len(content) != length or not line.same_shape(filled.facts[hole], content):
            return False
    return True


class TextScope:
    """One request's (one tenant's) view of the memory: the facts of each system text it reads."""

    __slots__ = ("_memo", "_salt", "_seed", "_views", "detectors")

    def __init__(self, memo: TextMemo, salt: int, detectors: tuple[Detector, ...]) -> None:
        self._memo = memo
        self._salt = salt
        self._seed = salt & 0xFFFF_FFFF_FFFF_FFFF
        self.detectors = detectors
        # The facts of the texts read in this request, by identity (the layout asks again).
        self._views: dict[int, tuple[str, TextFacts]] = {}

    def facts(self, text: str, place: str) -> TextFacts:
        known = self._views.get(id(text))
        if known is not None and known[0] is text:
            return known[1]
        found = self._facts(text, place)
        self._views[id(text)] = (text, found)
        return found

    def _facts(self, text: str, place: str) -> TextFacts:
        memo = self._memo
        place_key = (self._salt, place)  # a place is one tenant's, whatever its name says
        spot = memo._places.get(place_key) if place else None
        if spot is not None:
            # The place's text, or that text with other lines in its holes: its stretches tell.
            contents = spot.fill(text)
            if contents is not None:
                return self._filled(spot, text, contents)
        digest = xxhash.xxh3_128_intdigest(_text_bytes(text), seed=self._seed)
        found = memo._texts.get(digest)
        if found is None:
            found = self._read(text)
            if memo._seen.add(digest):
                _keep(memo._texts, digest, found)  # seen twice: kept
        if place:
            self._settle(place_key, spot, found, text)
        return found

    def _keys(self, lines: Sequence[str]) -> array[int]:
        return array("q", map((self._salt).__xor__, map(hash, lines)))

    def _read(self, text: str) -> TextFacts:
        """A text read whole."""
        lines = text.split("\n")
        keys = self._keys(lines)
        facts = self._memo.line_facts(keys, lines)
        starts = array("q", [0])
        position = 0
        for size in map(len, lines):
            position += size + 1
            starts.append(position)
        return TextFacts(keys, facts, starts).prepare(text, self.detectors)

    def _filled(self, spot: _Place, text: str, contents: list[str]) -> TextFacts:
        """The place's text with its holes' lines replaced."""
        base = spot.facts
        new_keys = self._keys(contents)
        if all(base.keys[h] == k for h, k in zip(spot.holes, new_keys, strict=True)):
            return base
        known = tuple(new_keys)
        if spot.filled is not None and spot.filled[0] == known:
            return spot.filled[1]
        keys = base.keys[:]
        facts = base.facts[:]
        hashes = base.hashes[:]
        lines = self._memo.line_facts(new_keys, contents)
        for hole, key, line in zip(spot.holes, new_keys, lines, strict=True):
            keys[hole] = key
            facts[hole] = line
            hashes[hole] = line.hash
        # What the environment detector asks of the whole text before it reads lines.
        marked = ":" in text or "</" in text
        previous = spot.filled[1] if spot.filled is not None else None
        if (
            previous is not None
            and self._memo.reshapes
            and previous.memo.get("marked") == marked
            and _same_shapes(previous, lines, contents)
        ):
            # The place's last filled text, but for the holes' text (a clock that ticked): read alike.
            filled = previous.reshaped(keys, facts, hashes)
            filled.memo["marked"] = marked
            spot.filled = (known, filled)
            return filled
        deltas = []
        shift = 0
        for hole, content in zip(spot.holes, contents, strict=True):
            shift += len(content) - (base.start(hole + 1) - 1 - base.start(hole))
            deltas.append(shift)
        filled = TextFacts(keys, facts, base.memo["starts"], hashes, base, spot.holes, tuple(deltas))
        filled.memo["marked"] = marked
        spot.filled = (known, filled.prepare(text, self.detectors))
        return filled

    def _settle(self, place: tuple[int, str], spot: _Place | None, found: TextFacts, text: str) -> None:
        """Remember the text read whole as its place's, with the lines that differ from the last one."""
        if spot is not None and spot.facts is found:
            return
        holes: tuple[int, ...] = ()
        if spot is not None and spot.facts.n == found.n:
            changed = set(compress(range(found.n), map(ne, spot.facts.keys, found.keys)))
            changed.update(spot.holes)
            if len(changed) <= min(MAX_HOLES, max(1, found.n // 4)):
                holes = tuple(sorted(changed))
        memo = self._memo
        _keep(memo._places, place, _Place(found, text, holes, self._seed))
        while len(memo._places) > memo._place_count:
            memo._places.popitem()


def _keep(cache: LRUCache[Any, Any], key: Any, value: Any) -> None:
    """``cache[key] = value``, unless the value alone is larger than the whole cache (a text of more
    lines than ``canon.text_memory_lines``): then it is read again when it comes again."""
    if cache.getsizeof(value) <= cache.maxsize:
        cache[key] = value
