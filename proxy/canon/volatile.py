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
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import xxhash

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


def detect_datetimes(text: str) -> Iterable[Span]:
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
    for match in _UUID.finditer(text):
        yield Span(match.start(), match.end(), "uuid")


def detect_request_ids(text: str) -> Iterable[Span]:
    for match in _REQUEST_ID.finditer(text):
        value = match.group(0)
        if any(c.isdigit() for c in value) and any(c.isalpha() for c in value):
            yield Span(match.start(), match.end(), "request_id")


BUILTIN_DETECTORS: dict[DetectorName, Detector] = {
    "context_block": detect_context_blocks,
    "datetime": detect_datetimes,
    "weekday": detect_weekdays,
    "uuid": detect_uuids,
    "request_id": detect_request_ids,
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
        self._lines: OrderedDict[int, tuple[tuple[int, int, str], ...]] = OrderedDict()
        self._max_lines = max_lines

    def get(self, line: str, detectors: list[Detector]) -> tuple[tuple[int, int, str], ...]:
        key = xxhash.xxh3_64_intdigest(line.encode("utf-8", "surrogatepass"))
        found = self._lines.get(key)
        if found is None:
            found = _scan_line(line, detectors)
            self._lines[key] = found
            if len(self._lines) > self._max_lines:
                self._lines.popitem(last=False)
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
