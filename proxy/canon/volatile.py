"""Built-in detectors of request-unique text (volatile spans) in system prompts.

Rule for dates (what is NOT moved): a date is volatile only when it reads like
a clock or a stamp, not like part of an instruction. It is moved when it carries
a time of day (a clock reading such as ``14:03`` or ``02:03:11 PM``), or when it
stands on a short metadata line (``Current date: 2026-11-29``, ``Today is
Sunday``): at most :data:`METADATA_LINE_BYTES` UTF-8 bytes of other text on its
line. A date inside an instruction sentence (``Only cite laws passed after
2021-01-01.``) stays where it is, unless a user rule or learned volatility says
otherwise. UUIDs and long hex request ids are always moved: they are unique to
one request by nature.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import xxhash
from cachetools import FIFOCache, LRUCache

from proxy.config import DetectorName

METADATA_LINE_BYTES = 48

_MONTHS = r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"  # noqa: E501
_WEEKDAYS = r"(?:Mon(?:day)?|Tue(?:s(?:day)?)?|Wed(?:nesday)?|Thu(?:rs(?:day)?)?|Fri(?:day)?|Sat(?:urday)?|Sun(?:day)?)"
_CLOCK = r"\d{1,2}[:：]\d{2}(?:[:：]\d{2}(?:\.\d+)?)?(?:\s?[AaPp]\.?[Mm]\.?)?"
_TZ = r"(?:\s?(?:Z|UTC|GMT|[+-]\d{2}:?\d{2}|[A-Z]{3,4}))?"

_DATETIME_PATTERNS = [
    # ISO 8601 date with optional time: 2026-11-29, 2026-11-29T14:03:11.123+08:00
    rf"\b\d{{4}}-\d{{2}}-\d{{2}}(?:[T ]{_CLOCK}{_TZ})?",
    # RFC 2822: Sun, 29 Nov 2026 14:03:11 +0000
    rf"\b(?:{_WEEKDAYS},\s)?\d{{1,2}}\s{_MONTHS}\s\d{{4}}(?:\s{_CLOCK}{_TZ})?",
    # November 29, 2026 (, 2:03 PM)
    rf"\b{_MONTHS}\.?\s\d{{1,2}}(?:st|nd|rd|th)?,?\s\d{{4}}(?:,?\s(?:at\s)?{_CLOCK}{_TZ})?",
    # 2026/11/29 14:03, 11/29/2026
    rf"\b\d{{4}}/\d{{1,2}}/\d{{1,2}}(?:\s{_CLOCK})?",
    rf"\b\d{{1,2}}/\d{{1,2}}/\d{{4}}(?:\s{_CLOCK})?",
    # Chinese: 2026年11月29日 14:03, 11月29日
    rf"(?:\d{{4}}年)?\d{{1,2}}月\d{{1,2}}[日号](?:\s*(?:上午|下午|晚上|凌晨)?\s*{_CLOCK}|\s*\d{{1,2}}[点时](?:\d{{1,2}}分)?)?",
    # a bare clock reading: 14:03:11, 02:03:11 PM
    rf"(?<![\d:：]){_CLOCK}{_TZ}(?![\d:：])",
    # unix epoch seconds / milliseconds (2001-2286)
    r"\b1\d{9}(?:\d{3})?\b",
]
_DATETIME = re.compile("|".join(f"(?:{p})" for p in _DATETIME_PATTERNS))
_HAS_CLOCK = re.compile(rf"{_CLOCK}|\d{{1,2}}[点时]")
_WEEKDAY = re.compile(rf"\b{_WEEKDAYS}\b|星期[一二三四五六日天]|周[一二三四五六日]|礼拜[一二三四五六日天]")
_UUID = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
# Long hex ids and prefixed ids (req_..., chatcmpl-..., trace ids). Requires a digit and a letter
# so ordinary words and numbers are left alone.
_REQUEST_ID = re.compile(
    r"\b(?:[0-9a-f]{16,}|[0-9A-F]{16,}|(?:req|request|trace|span|msg|run|chatcmpl|call|sess(?:ion)?)[-_][A-Za-z0-9]{8,})\b"
)
_CONTEXT_BLOCK = re.compile(r"<context>.*?</context>", re.DOTALL)


# Kinds of span that move at a conversation's first request, before their place is seen to vary:
# what an agent reports about its machine (working directory, git status, recent commits, the
# date) changes between turns by nature, and moving it only once it has changed cannot help the
# turn where it first changes (everything after it, the tools included, is recomputed then).
FIRST_SIGHT_KINDS = frozenset({"environment"})


@dataclass(frozen=True, slots=True, order=True)
class Span:
    start: int
    end: int
    kind: str


Detector = Callable[[str], Iterable[Span]]


def _line_bounds(text: str, start: int, end: int) -> tuple[int, int]:
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", end)
    return line_start, len(text) if line_end < 0 else line_end


def _on_metadata_line(text: str, span_start: int, span_end: int, pattern: re.Pattern[str]) -> bool:
    """True when the span's line is mostly stamp: little other text besides dates and weekdays."""
    line_start, line_end = _line_bounds(text, span_start, span_end)
    line = text[line_start:line_end]
    residue = _WEEKDAY.sub("", pattern.sub("", line))
    residue = _DATETIME.sub("", residue)
    residue = residue.strip(" \t-—:：,.;|*#>()[]【】（）")
    # Bytes, not characters: a CJK character carries about as much as a short English word.
    return len(residue.encode("utf-8", "surrogatepass")) <= METADATA_LINE_BYTES


def detect_context_blocks(text: str) -> Iterable[Span]:
    if "<context>" not in text:
        return
    for match in _CONTEXT_BLOCK.finditer(text):
        yield Span(match.start(), match.end(), "context_block")


# Every date and clock pattern holds a digit, and every id one of 0-9: text without one has none.
_ASCII_DIGIT = re.compile(r"[0-9]")
# What every date or clock pattern holds: four digits (a year, an epoch), a month character, or a
# digit, a colon and a digit (a clock).
_DATE_MARK = re.compile(r"\d{4}|月|\d[:：]\d")


def detect_datetimes(text: str) -> Iterable[Span]:
    if _DATE_MARK.search(text) is None:
        return
    for match in _DATETIME.finditer(text):
        value = match.group(0)
        if not value.strip():
            continue
        if _HAS_CLOCK.search(value) or _on_metadata_line(text, match.start(), match.end(), _DATETIME):
            yield Span(match.start(), match.end(), "datetime")


def detect_weekdays(text: str) -> Iterable[Span]:
    for match in _WEEKDAY.finditer(text):
        if _on_metadata_line(text, match.start(), match.end(), _WEEKDAY):
            yield Span(match.start(), match.end(), "weekday")


def detect_uuids(text: str) -> Iterable[Span]:
    if "-" not in text:
        return
    for match in _UUID.finditer(text):
        yield Span(match.start(), match.end(), "uuid")


def detect_request_ids(text: str) -> Iterable[Span]:
    if _ASCII_DIGIT.search(text) is None:
        return
    for match in _REQUEST_ID.finditer(text):
        value = match.group(0)
        if any(c.isdigit() for c in value) and any(c.isalpha() for c in value):
            yield Span(match.start(), match.end(), "request_id")


# -- agents' environment blocks ------------------------------------------------------------------
#
# Coding agents tell the model about the machine they run on: the working directory, whether it is a
# git repository, the platform, today's date, the branch, `git status --short` and recent commits
# (Claude Code's `<env>` block and `gitStatus:` section, opencode's `<env>` and `<files>`). Such a block
# is recognized by what its lines read as, not by one client's wording: facts of the form
# ``key: value`` whose key names something about the environment (or whose value is an absolute path),
# porcelain status lines, commit lines (a hash and a subject), and, under a header, file paths. A run
# of them (blank lines and headers between them allowed), or a tag-delimited block made mostly of
# them, is one span, its introducing line ("Here is useful information about the environment ...:")
# included. It moves at a conversation's first request (FIRST_SIGHT_KINDS).

_ENV_KEY = re.compile(
    r"^\s*(?:[-*•]\s+)?(?:"
    r"(?:current\s+)?(?:working|project|workspace|home|root|repo(?:sitory)?|git)\s*(?:dir(?:ectory)?|folder|root|path)"
    r"|cwd|pwd|workspace|(?:is\s+)?(?:the\s+)?(?:directory|folder)\s+a\s+git\s+repo(?:sitory)?"
    r"|git\s*(?:status|repo(?:sitory)?|branch)|(?:current|main|default|base)\s+branch|branch"
    r"|platform|os(?:\s+version)?|operating\s+system|kernel|shell|terminal|architecture|arch"
    r"|today'?s\s+date|current\s+(?:date|time|date\s+and\s+time)|date|time|timezone|time\s+zone|locale"
    r"|(?:node|python|go|rust|java)(?:\.js)?\s+version|user(?:name)?|hostname|host"
    r")(?:\s*\([^)\n]{0,100}\))?\s*[:=]",
    re.IGNORECASE,
)
_PATH_VALUE = re.compile(r"^\s*(?:[-*•]\s+)?[\w .'()-]{2,48}:\s*(?:/|~/|[A-Za-z]:\\)\S*\s*$")
_PORCELAIN = re.compile(r"^\s?[MADRCUT?!]{1,2}\s+\S*[./]\S*\s*$")
# A commit line: an abbreviated or full hash (a digit and a letter a-f), then the subject.
_COMMIT = re.compile(r"^\s*(?:[-*•]\s+)?(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b\s+\S")
# One whose abbreviated hash has no letter (about 4% of 7-character ones: "5949420 Initial commit")
# reads like a numbered line ("20241225 Christmas Day", a phone number): it belongs to an environment
# block only under a header within a run of facts ("Recent commits:" after "Current branch: main").
_NUMBERED_COMMIT = re.compile(r"^\s*(?:[-*•]\s+)?[0-9]{7,12}\s+\S")
_TREE = r"(?:[│├└─|`+\\ -]+\s*)?"  # tree-drawing prefixes of a file listing
_FILE_PATH = re.compile(
    rf"^\s*{_TREE}[\w@.+~-]*(?:[/\\][\w@.+~ -]*)+/?\s*$"  # a path with a separator
    rf"|^\s*{_TREE}[\w@+~-][\w@.+~-]*\.\w{{1,10}}/?\s*$"  # a file name with an extension
)
_PARENTHESIZED = re.compile(r"^\s*\([^)]{1,60}\)\s*$")
_TAG_OPEN = re.compile(r"^\s*<([A-Za-z][\w-]{0,40})(?:\s[^<>]*)?>\s*$")
_HEADER_MAX_CHARS = 100
# A tag block is an environment block when at least this share of its inner lines are facts or paths.
_ENV_BLOCK_SHARE = 0.6
_MAX_BLOCK_LINES = 400

_FACT, _PATH, _HEADER, _BLANK, _OTHER, _LISTED = range(6)
# A ``key: /absolute/path`` line whose key names nothing about the environment: a fact beside others
# (a project's root among the working directory and the branch), never one alone, since a list of a
# tool's install paths or of documents (``- Main documentation: /usr/lib/...``) reads the same.
_PATH_FACT = 6
_FACTS = (_FACT, _PATH_FACT)
# Kinds a run of facts takes in under a header (a file listing, a list of commits).
_UNDER_HEADER = (_PATH, _LISTED)


def _line_kind(line: str) -> int:
    stripped = line.strip()
    if not stripped:
        return _BLANK
    # Each pattern is tried only where its required character is (a key ends with ':' or '=', a
    # commit hash holds a digit, a status or file line a '.' or a separator, a note a parenthesis).
    keyed = ":" in line or "=" in line
    path_like = "." in line or "/" in line or "\\" in line
    if (
        (keyed and _ENV_KEY.match(line))
        or (_ASCII_DIGIT.search(line) and _COMMIT.match(line))
        or (path_like and _PORCELAIN.match(line))
    ):
        return _FACT
    if keyed and _PATH_VALUE.match(line):
        return _PATH_FACT
    if (path_like and _FILE_PATH.match(line)) or ("(" in line and _PARENTHESIZED.match(line)):
        return _PATH
    if (stripped[0].isdigit() or stripped[0] in "-*•") and _NUMBERED_COMMIT.match(line):
        return _LISTED
    if stripped.endswith(":") and len(stripped) <= _HEADER_MAX_CHARS:
        return _HEADER
    return _OTHER


def _environment_runs(lines: list[str], kinds: list[int]) -> list[tuple[int, int]]:
    """Runs of facts (at least two different ones: one line repeated describes nothing more; and one
    that names something about the environment, not only paths), with the headers, blank lines and
    (under a header) paths between them; as (first line, last line)."""
    found: list[tuple[int, int]] = []
    index = 0
    while index < len(kinds):
        if kinds[index] not in _FACTS:
            index += 1
            continue
        first = last = index
        facts = {lines[index].strip()}
        named = kinds[index] == _FACT
        cursor = index + 1
        under_header = False
        while cursor < len(kinds):
            kind = kinds[cursor]
            if kind in _FACTS or (kind in _UNDER_HEADER and under_header):
                if kind in _FACTS:
                    facts.add(lines[cursor].strip())
                    named = named or kind == _FACT
                last = cursor
            elif kind == _HEADER:
                # A header belongs to the run only with facts or paths under it.
                following = next((k for k in kinds[cursor + 1 :] if k != _BLANK), _OTHER)
                if following not in _FACTS and following not in _UNDER_HEADER:
                    break
                under_header = True
                facts.add(f"\x00header {cursor}")
                last = cursor
            elif kind == _BLANK:
                if cursor + 1 < len(kinds) and kinds[cursor + 1] == _BLANK:
                    break  # two blank lines end a section
                under_header = False
            else:
                break
            cursor += 1
        if len(facts) >= 2 and named:
            found.append((first, last))
        index = cursor
    return found


def _environment_tags(lines: list[str], kinds: list[int]) -> list[tuple[int, int]]:
    """Tag-delimited blocks (``<env>`` ... ``</env>`` on lines of their own) made mostly of facts
    and paths."""
    found: list[tuple[int, int]] = []
    for index, line in enumerate(lines):
        match = _TAG_OPEN.match(line)
        if match is None:
            continue
        closing = f"</{match.group(1)}>"
        for end in range(index + 1, min(len(lines), index + _MAX_BLOCK_LINES)):
            if lines[end].strip() == closing:
                inner = [k for k in kinds[index + 1 : end] if k != _BLANK]
                facts = inner.count(_FACT) + inner.count(_PATH_FACT)
                paths = inner.count(_PATH)
                if inner and (facts or paths >= 3) and (facts + paths) >= _ENV_BLOCK_SHARE * len(inner):
                    found.append((index, end))
                break
            if _TAG_OPEN.match(lines[end]):
                break  # nested blocks: the innermost is judged on its own
    return found


def detect_environment_blocks(text: str) -> Iterable[Span]:
    if ":" not in text and "</" not in text:
        return ()
    key = xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))
    cached = _ENVIRONMENT_SPANS.get(key)
    if cached is None:
        cached = _ENVIRONMENT_SPANS[key] = tuple(_environment_spans(text))
    return cached


# A system prompt re-sent unchanged is a hash lookup (only hashes and offsets are kept).
_ENVIRONMENT_SPANS: LRUCache[int, tuple[Span, ...]] = LRUCache(4096)


def _environment_spans(text: str) -> list[Span]:
    lines = text.split("\n")
    kinds = [_line_kind(line) for line in lines]
    blocks = sorted(_environment_tags(lines, kinds) + _environment_runs(lines, kinds))
    merged: list[tuple[int, int]] = []
    for first, last in blocks:
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line) + 1)
    spans = []
    for first, last in merged:
        if first > 0 and kinds[first - 1] == _HEADER:
            first -= 1  # the line introducing the block goes with it
        spans.append(Span(starts[first], starts[last] + len(lines[last]), "environment"))
    return spans


BUILTIN_DETECTORS: dict[DetectorName, Detector] = {
    "context_block": detect_context_blocks,
    "datetime": detect_datetimes,
    "weekday": detect_weekdays,
    "uuid": detect_uuids,
    "request_id": detect_request_ids,
    "environment": detect_environment_blocks,
}


def regex_detector(name: str, pattern: str) -> Detector:
    compiled = re.compile(pattern, re.MULTILINE)

    def detect(text: str) -> Iterable[Span]:
        for match in compiled.finditer(text):
            if match.end() > match.start():
                yield Span(match.start(), match.end(), f"rule:{name}")

    return detect


def marker_detector(name: str, start_marker: str, end_marker: str) -> Detector:
    """Text between two explicit markers (markers included) is volatile."""

    def detect(text: str) -> Iterable[Span]:
        position = 0
        while (start := text.find(start_marker, position)) >= 0:
            end = text.find(end_marker, start + len(start_marker))
            if end < 0:
                return
            end += len(end_marker)
            yield Span(start, end, f"rule:{name}")
            position = end

    return detect


def line_local(detector: Detector) -> Detector:
    """Mark a detector whose spans depend on their own line only, so results can be memoized per line."""
    detector.line_local = True  # type: ignore[attr-defined]
    return detector


for _detector in (detect_datetimes, detect_weekdays, detect_uuids, detect_request_ids):
    line_local(_detector)


class DetectionCache:
    """Line-local detections memoized by an xxh3 hash of the line (no text is kept).

    An app's system prompt repeats most of its lines from one request to the next, so only
    the lines that changed are scanned again. Valid for one fixed set of detectors.
    """

    def __init__(self, max_lines: int = 50_000) -> None:
        # Oldest scanned out first: a line found again is no use.
        self._lines: FIFOCache[int, tuple[tuple[int, int, str], ...]] = FIFOCache(max_lines)

    def get(self, line: str, detectors: list[Detector]) -> tuple[tuple[int, int, str], ...]:
        key = xxhash.xxh3_64_intdigest(line.encode("utf-8", "surrogatepass"))
        found = self._lines.get(key)
        if found is None:
            found = self._lines[key] = _scan_line(line, detectors)
        return found


def _scan_line(line: str, detectors: list[Detector]) -> tuple[tuple[int, int, str], ...]:
    return tuple((span.start, span.end, span.kind) for detector in detectors for span in detector(line))


def detect_spans(text: str, detectors: Iterable[Detector], cache: DetectionCache | None = None) -> list[Span]:
    detectors = list(detectors)
    local = [d for d in detectors if getattr(d, "line_local", False)]
    spans: list[Span] = [span for d in detectors if d not in local for span in d(text)]
    if local:
        offset = 0
        for line in text.split("\n"):
            if line.strip():
                found = cache.get(line, local) if cache is not None else _scan_line(line, local)
                spans.extend(Span(offset + start, offset + end, kind) for start, end, kind in found)
            offset += len(line) + 1
    return sorted(spans)
