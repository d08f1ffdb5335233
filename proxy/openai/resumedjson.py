"""A request body parsed as what it shares with the tenant's last bodies, plus what is new.

A client re-sends a conversation's whole history on every turn: at 1,000 turns an agent's body is a
megabyte, and parsing it and writing it upstream again cost more than everything else the proxy
does for the request. But all of it except the last few messages is, byte for byte, text the
tenant sent before, whose value the proxy already holds.

So, per tenant, the array of each body (``messages``, or a Responses ``input`` list) is kept as a
*run*: its elements from the first one after the leading system messages, their bytes in the body,
and where each element ends. A new body is scanned from its start only as far as an element that
begins a run kept (found by its first bytes: the keys before the array, and the array's few
leading elements, are skipped one value at a time); where the body's bytes go on as the run's up
to one of its element ends, those elements are taken as the values parsed before, and only the
rest of the body is parsed, the run replaced by a placeholder string. The run of the new body is
the old one's elements and what follows them (scanned one element at a time: what is new).

Exact, not a heuristic. The scan only proposes where the run starts (it skips strings and counts
brackets over the bytes: JSON's structure is ASCII, and no byte of a multi-byte UTF-8 character is, so
nothing is decoded); the parse of the rest proves it: the placeholder must come back as the array's
element at the index the scan counted (a random string no client sends), and the run's bytes are
byte-identical to whole elements parsed before, so putting them where the placeholder is gives the
value of parsing the whole body. Anything else (the placeholder elsewhere, text orjson refuses, an
array key given twice) and the body is parsed whole. The first time a run is resumed, where its
elements end is not known yet (the body it came from was parsed whole): where the new body repeats
all of it, one parse in C of the bytes up to where the two stop agreeing proves it; where it repeats
part (an edited message), its elements are found one by one, each checked against the values parsed.

The body written upstream reuses a run the same way (:func:`dumps_body`): orjson's bytes of its
elements are kept with it, the new ones appended, so writing the body costs what is new too; the
bytes are those writing the whole body makes.

Bounded: the runs kept hold their bodies' bytes and are forgotten least recently used first
(``MAX_BYTES`` together); a run superseded by the next request of its conversation is dropped. A
small body (``MIN_BYTES``, ``MIN_HISTORY_BYTES``) is parsed whole: orjson does it in less time than
the scan and the splice take.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import compress, islice
from itertools import count as count_from
from operator import is_not
from typing import Any

import orjson
import xxhash
from cachetools import LRUCache

from proxy.openai.jsonio import dumps, loads, shared_json
from proxy.openai.messages import leading_system_count

# The keys whose array a client re-sends growing: chat's and Anthropic's messages, Responses' input.
ARRAY_KEYS = frozenset({"messages", "input"})
# Bytes of an element that name the runs starting with it.
HEAD_BYTES = 256
# Runs kept per head: conversations that open alike (a greeting, an agent's task template).
CANDIDATES = 4
# Elements of an array looked at for the start of a run (its leading system messages are skipped).
MAX_SCANNED = 8
# Bodies smaller than this are parsed whole, and those whose history (what follows their leading
# system messages) is: below about 90 KB, orjson parses and writes a body whole in less than the
# scan, the lookups and the splice cost (about 0.2 ms; measured on Dify and agent conversations).
MIN_BYTES = 96 * 1024
MIN_HISTORY_BYTES = 64 * 1024
# The runs kept, by the bytes of their bodies and of their elements written.
MAX_BYTES = 64 * 1024 * 1024
# A run's last elements a body written may lack, and still have the rest written from the run's bytes.
MAX_UNWRITTEN = 8

_WHITESPACE = re.compile(rb"[ \t\n\r]*")
_STRUCTURE = re.compile(rb'["{}\[\]]')
_SCALAR = re.compile(rb"[^ \t\n\r,\]}]+")
_QUOTE, _BACKSLASH, _COLON, _COMMA = ord('"'), ord("\\"), ord(":"), ord(",")
_OPEN_OBJECT, _OPEN_ARRAY, _CLOSE_ARRAY = ord("{"), ord("["), ord("]")
_OPENING = frozenset(b"{[")
_CONTAINERS = frozenset(b'{["')
_BYTES_WHITESPACE = b" \t\n\r"
# A string no client sends (random per process): the placeholder for a run in the text parsed.
_PLACEHOLDER = "\x00prefix-proxy-run-" + secrets.token_hex(16)
_PLACEHOLDER_JSON = json.dumps(_PLACEHOLDER).encode()
# Where an array written from a run goes in the body written around it (:func:`dumps_body`): raw
# bytes orjson places as they are, with a NUL that orjson's own output never holds (it writes
# control characters escaped), so the body written splits at it and only there.
_SLOTS = {key: b"\x00prefix-proxy-slot-" + key.encode() + secrets.token_hex(16).encode() for key in sorted(ARRAY_KEYS)}
# The pieces of a run's bytes written kept apart before they are joined once into one.
MAX_PIECES = 32

Bytes = bytes | memoryview


@dataclass(eq=False, slots=True)
class Run:
    """An array's elements from one on, as one body sent them."""

    raw: bytes
    start: int  # where the first element starts in ``raw``
    elements: list[Any]
    # Byte offsets (from ``start``) where elements end, ascending, and how many elements end by each.
    ends: list[int]
    counts: list[int]
    # ``ends[-1]`` is the end of the last element (else where they end is not known yet).
    complete: bool
    # orjson's bytes of ``elements`` once written, as pieces to join with commas (a run continued
    # from another adds one piece to the other's: nothing copied); ``base``: those of the first
    # ``base_count`` of them, from the run this one continues.
    written: tuple[Bytes, ...] | None = None
    base: tuple[Bytes, ...] | None = None
    base_count: int = 0
    unusable: bool = False
    head: int = 0  # what names it (:func:`_head`)

    def size(self) -> int:
        # Its body, the bytes of its elements written (about as many, once written), their objects.
        return 2 * len(self.raw) + sum(map(len, self.base or ())) + 64 * len(self.elements) + 256


def _runs_size(runs: tuple[Run, ...]) -> int:
    return sum(run.size() for run in runs) + 64


_BY_HEAD: LRUCache[tuple[str, int], tuple[Run, ...]] = LRUCache(MAX_BYTES, getsizeof=_runs_size)
# Per tenant and key, the text of the value before the array it sent last (``_skip_value``).
_VALUES: LRUCache[tuple[str, str], bytes] = LRUCache(16 * 1024 * 1024, getsizeof=len)
# Shorter values are scanned each time.
MIN_VALUE_CHARS = 256
# Runs by the identity of their first element (held by the run), for writing a body.
_BY_FIRST: LRUCache[int, Run] = LRUCache(MAX_BYTES, getsizeof=Run.size)


def resumed_loads(raw: bytes, namespace: str) -> Any:
    """``loads(raw)``, parsing only what the tenant's last bodies did not send (see the module)."""
    if len(raw) < MIN_BYTES:
        return loads(raw)
    scanned = _Scanned()
    try:
        found = _resume(raw, namespace, scanned)
    except (ValueError, IndexError, UnicodeDecodeError, RecursionError, _ShortHistory):
        # Whatever the scan of a body makes of it, the full parse says what it is (and refuses it
        # as the engine would): a scan never answers for a body it could not read.
        return loads(raw)
    if found is not None:
        return found
    body = loads(raw)
    _keep_whole(raw, namespace, scanned, body)
    return body


def forget() -> None:
    """Drop every run kept (tests; a reload that changes tenants)."""
    _BY_HEAD.clear()
    _BY_FIRST.clear()
    _VALUES.clear()


# -- reading a body -----------------------------------------------------------------------------


class _ShortHistory(Exception):
    """What follows a body's leading system messages is too short to be worth resuming."""


@dataclass(slots=True)
class _Scanned:
    """A body's array, as far as it was scanned: its key, and its leading elements' byte offsets
    (``starts``, ``ends``)."""

    key: str = ""
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)


def _ws(raw: bytes, position: int) -> int:
    return _WHITESPACE.match(raw, position).end()  # type: ignore[union-attr]


def _resume(raw: bytes, namespace: str, scanned: _Scanned) -> Any | None:
    """The body, from a run kept that starts at one of its array's leading elements; None where
    none does (``scanned`` then holds what the scan found).

    The scan reads bytes: JSON's structure is ASCII, and no byte of a character UTF-8 writes in
    more than one byte is ASCII, so offsets are the body's own and nothing is decoded."""
    position = _ws(raw, 0)
    if raw[position] != _OPEN_OBJECT:
        raise ValueError("not an object")
    position = _ws(raw, position + 1)
    while True:
        if raw[position] != _QUOTE:
            raise ValueError("no array")
        end = _skip_string(raw, position)
        key = _key(raw[position:end])
        position = _ws(raw, end)
        if raw[position] != _COLON:
            raise ValueError("not an object")
        position = _ws(raw, position + 1)
        if key in ARRAY_KEYS and raw[position] == _OPEN_ARRAY:
            scanned.key = key
            return _scan_array(raw, namespace, scanned, position + 1)
        position = _ws(raw, _skip_value(raw, position, (namespace, key)))
        if raw[position] != _COMMA:
            raise ValueError("no array")
        position = _ws(raw, position + 1)


def _key(quoted: bytes) -> str:
    if b"\\" not in quoted:
        return quoted[1:-1].decode("utf-8")
    key = json.loads(quoted)
    if not isinstance(key, str):
        raise ValueError("not a key")
    return key


def _skip(raw: bytes, position: int) -> int:
    """The end of the JSON value at ``position``, found without parsing it: strings jumped over to
    their closing quote, brackets counted (C searches; a long system prompt is one or two). Only a
    proposal where the text is not JSON: what is taken from a run is proven by the parse of the
    rest (``_splice``: the placeholder found where it was put, as an element of the array)."""
    first = raw[position]
    if first == _QUOTE:
        return _skip_string(raw, position)
    if first not in _OPENING:
        scalar = _SCALAR.match(raw, position)  # a number or a literal
        if scalar is None:
            raise ValueError("no JSON value here")  # a body the full parse refuses (a missing value)
        return scalar.end()
    depth = 0
    while True:
        found = _STRUCTURE.search(raw, position)
        if found is None:
            raise ValueError("unterminated")
        position = found.start()
        byte = raw[position]
        if byte == _QUOTE:
            position = _skip_string(raw, position)
            continue
        depth += 1 if byte in _OPENING else -1
        position += 1
        if not depth:
            return position


def _skip_string(raw: bytes, position: int) -> int:
    """Past the string whose opening quote is at ``position``."""
    end = position + 1
    while True:
        end = raw.find(b'"', end)
        if end < 0:
            raise ValueError("unterminated string")
        backslashes = end - 1
        while raw[backslashes] == _BACKSLASH:
            backslashes -= 1
        if (end - 1 - backslashes) % 2 == 0:
            return end + 1
        end += 1


def _skip_value(raw: bytes, position: int, place: tuple[str, str]) -> int:
    """Past the value at ``position``: the bytes the tenant sent at this key last, where they are
    the same (an object, array or string ends where its text does: a tool list is not scanned
    again), else scanned."""
    last = _VALUES.get(place)
    if last is not None and raw.startswith(last, position):
        return position + len(last)
    end = _skip(raw, position)
    if end - position >= MIN_VALUE_CHARS and raw[position] in _CONTAINERS:
        _VALUES[place] = raw[position:end]
    return end


def _scan_array(raw: bytes, namespace: str, scanned: _Scanned, position: int) -> Any | None:
    """Element by element, until one starts a run kept (the body then), the array ends or
    ``MAX_SCANNED`` are looked at (None)."""
    position = _ws(raw, position)
    if raw[position] == _CLOSE_ARRAY:
        return None
    for index in range(MAX_SCANNED):
        if len(raw) - position < MIN_HISTORY_BYTES:
            raise _ShortHistory()  # a one-shot request or a short conversation: parsed whole, not kept
        end = _skip(raw, position)
        scanned.starts.append(position)
        scanned.ends.append(end)
        body = _resume_at(raw, namespace, scanned, index)
        if body is not None:
            return body
        position = _ws(raw, end)
        if raw[position] == _CLOSE_ARRAY:
            return None
        if raw[position] != _COMMA:
            raise ValueError("not an array")
        position = _ws(raw, position + 1)
    return None


def _head(raw: bytes, start: int, end: int) -> int:
    """What names the runs starting with the element at ``raw[start:end]``: its first bytes."""
    return xxhash.xxh3_64_intdigest(raw[start : min(end, start + HEAD_BYTES)])


def _resume_at(raw: bytes, namespace: str, scanned: _Scanned, index: int) -> Any | None:
    start = scanned.starts[index]
    candidates = _BY_HEAD.get((namespace, _head(raw, start, scanned.ends[index])))
    if not candidates:
        return None
    best: tuple[int, int, Run] | None = None
    for run in candidates:
        count, length = _usable(raw, start, run)
        if count and (best is None or count > best[0]):
            best = (count, length, run)
    if best is None:
        return None
    return _splice(raw, namespace, scanned.key, index, (start, scanned.ends[index]), *best)


def _agreeing_bytes(a: bytes, a_start: int, b: bytes, b_start: int, limit: int) -> int:
    """How many bytes from ``a[a_start]`` and ``b[b_start]`` on (at most ``limit``) are equal:
    spans of doubling length compared in C (``startswith`` over a view: nothing copied), then
    halving the first that differs."""
    view = memoryview(a)
    low, step = 0, 4096  # equal before low
    while low < limit:
        high = min(low + step, limit)
        if not b.startswith(view[a_start + low : a_start + high], b_start + low):
            break
        low, step = high, step * 2
    else:
        return limit
    while high - low > 1:  # equal before low; not before high
        middle = (low + high) // 2
        if b.startswith(view[a_start + low : a_start + middle], b_start + low):
            low = middle
        else:
            high = middle
    return low


def _usable(raw: bytes, start: int, run: Run) -> tuple[int, int]:
    """How many of ``run``'s elements ``raw`` repeats from ``start``, and their bytes."""
    if run.unusable:
        return 0, 0
    limit = min(len(raw) - start, len(run.raw) - run.start)
    if run.complete:
        limit = min(limit, run.ends[-1])
    agreed = _agreeing_bytes(run.raw, run.start, raw, start, limit)
    if not run.complete and not _index(run, agreed):
        return 0, 0
    found = bisect_right(run.ends, agreed) - 1
    if found < 0:
        return 0, 0
    return run.counts[found], run.ends[found]


def _proven_whole(run: Run, agreed: int) -> bool:
    """Whether all of a run first seen whole is what another body repeats (a conversation that only
    grew): its elements end where the bodies stop agreeing, less whitespace, which one parse in C
    proves (the values must be the run's)."""
    raw, end = run.raw, run.start + agreed
    while end > run.start and raw[end - 1] in _BYTES_WHITESPACE:
        end -= 1
    try:
        whole = _same_json(orjson.loads(b"[" + raw[run.start : end] + b"]"), run.elements)
    except orjson.JSONDecodeError:
        return False
    if whole:
        run.ends, run.counts, run.complete = [end - run.start], [len(run.elements)], True
    return whole


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: Python's ``==`` alone takes ``true`` for ``1`` and ``1.0`` and objects for
    equal whatever their keys' order, so a body whose array key is given twice, the two arrays
    differing only so, would have the other one's values forwarded; orjson's bytes of each tell them
    apart (and ``==`` first: NaN, which orjson writes as null, is equal to nothing)."""
    try:
        return bool(a == b) and orjson.dumps(a) == orjson.dumps(b)
    except (TypeError, RecursionError):  # RecursionError: nested past Python's limit (orjson's is deeper)
        return False


def _index(run: Run, agreed: int) -> bool:
    """Where the elements of a run first seen whole end, up to the first past ``agreed`` (the bytes
    another body repeats): scanned one element at a time from the last end known (once per run; a
    run continued from another knows its ends), each element's value checked against the run's (the
    scan found the first array under its key, the parse kept the last). False where none ends
    within ``agreed``."""
    if not run.ends and _proven_whole(run, agreed):
        return True
    known = run.ends[-1] if run.ends else 0
    if known <= agreed:
        raw, position = run.raw, run.start + known
        ends, counts = list(run.ends), list(run.counts)
        count = counts[-1] if counts else 0
        try:
            while count < len(run.elements):
                start = _element_after(raw, position) if count else _ws(raw, position)
                if start is None:
                    break
                position = _skip(raw, start)
                # Another array than the one parsed (a key given twice):
                if not _same_json(orjson.loads(raw[start:position]), run.elements[count]):
                    raise ValueError("another array")
                count += 1
                ends.append(position - run.start)
                counts.append(count)
                if ends[-1] > agreed:
                    break
        except (ValueError, IndexError):
            run.unusable = True
            return False
        run.ends, run.counts = ends, counts
        run.complete = count == len(run.elements)
    return bool(run.ends) and run.ends[0] <= agreed


def _splice(
    raw: bytes, namespace: str, key: str, index: int, first: tuple[int, int], count: int, length: int, run: Run
) -> Any:
    """The body, ``run``'s first ``count`` elements (``length`` bytes) taken for its own from
    the array's element ``index`` (at ``first``: its start and end), the rest parsed; None where
    that does not hold."""
    start = first[0]
    after = start + length
    try:
        body = orjson.loads(raw[:start] + _PLACEHOLDER_JSON + raw[after:])
    except orjson.JSONDecodeError:
        return None
    array = body.get(key) if type(body) is dict else None
    if type(array) is not list or len(array) <= index or array[index] != _PLACEHOLDER:
        return None
    added = array[index + 1 :]
    elements = [*run.elements[:count], *added] if added else run.elements[:count]
    body[key] = [*array[:index], *elements]
    ends, counts, complete = _added_ends(raw, after, len(added))
    shared = bisect_right(run.ends, length)
    continued = Run(
        raw,
        start,
        elements,
        [*run.ends[:shared], *(length + end for end in ends)],
        [*run.counts[:shared], *(count + c for c in counts)],
        complete,
        head=_head(raw, *first),
    )
    whole = count == len(run.elements)
    if whole and run.written is not None:
        continued.base, continued.base_count = run.written, count
    elif whole and run.base is not None:
        continued.base, continued.base_count = run.base, run.base_count
    _keep(namespace, continued, run if whole else None)
    return body


def _added_ends(raw: bytes, after: int, added: int) -> tuple[list[int], list[int], bool]:
    """Where the ``added`` elements after a run end (byte offsets from ``after``), scanned."""
    if not added:
        return [], [], True
    ends, counts = [], []
    position = after
    try:
        for count in range(1, added + 1):
            start = _element_after(raw, position)
            if start is None:
                raise ValueError("not an array")
            position = _skip(raw, start)
            ends.append(position - after)
            counts.append(count)
    except (ValueError, IndexError):
        return ends, counts, False
    return ends, counts, True


def _element_after(raw: bytes, position: int) -> int | None:
    """Where the element after the one ending at ``position`` starts; None where none follows."""
    position = _ws(raw, position)
    return _ws(raw, position + 1) if raw[position] == _COMMA else None


# -- keeping runs -------------------------------------------------------------------------------


def _keep_whole(raw: bytes, namespace: str, scanned: _Scanned, body: Any) -> None:
    """Keep a body parsed whole as a run, from the element after its leading system messages
    (where its elements end is proven when a next body resumes it)."""
    array = body.get(scanned.key) if type(body) is dict and scanned.key else None
    if type(array) is not list:
        return
    index = leading_system_count(array, MAX_SCANNED)
    if index >= len(scanned.starts) or index >= len(array):
        return
    start = scanned.starts[index]
    run = Run(raw, start, array[index:], [], [], False, head=_head(raw, start, scanned.ends[index]))
    _keep(namespace, run, None)


def _keep(namespace: str, run: Run, superseded: Run | None) -> None:
    key = (namespace, run.head)
    others = tuple(kept for kept in _BY_HEAD.get(key, ()) if kept is not superseded)
    runs = (run, *others[: CANDIDATES - 1])
    if _runs_size(runs) <= MAX_BYTES:
        _BY_HEAD[key] = runs
        if run.elements:
            _BY_FIRST[id(run.elements[0])] = run


# -- writing a body -----------------------------------------------------------------------------


def _written(run: Run) -> tuple[Bytes, ...]:
    if run.written is None:
        if run.base is not None and run.base_count:
            rest = run.elements[run.base_count :]
            pieces = (*run.base, memoryview(orjson.dumps(rest))[1:-1]) if rest else run.base
            if len(pieces) > MAX_PIECES:
                pieces = (b",".join(pieces),)
            run.written = pieces
        else:
            run.written = (memoryview(orjson.dumps(run.elements))[1:-1],)
        run.base = None
    return run.written


def _run_held(items: list[Any]) -> tuple[int, Run] | None:
    """A run whose first element is one of ``items``' first few (canonicalization puts a few
    system messages before a history), and where."""
    for offset, item in enumerate(islice(items, MAX_SCANNED * 2)):
        run = _BY_FIRST.get(id(item))
        if run is not None and run.elements[0] is item:
            return offset, run
    return None


def _array_pieces(items: list[Any]) -> list[Bytes] | None:
    """orjson's bytes of ``items``, brackets aside, as pieces to join with commas, with a run it
    holds written from the run's bytes: all of it, or all but its last few elements (a rewrite puts
    a moved block before the last user message)."""
    held = _run_held(items)
    if held is None:
        return None
    offset, run = held
    count = len(run.elements)
    # The run's leading elements that ``items`` holds from ``offset`` on (compared in C, by identity).
    differing = compress(count_from(), map(is_not, islice(items, offset, offset + count), run.elements))
    shared = min(next(differing, count), len(items) - offset)
    if count - shared > MAX_UNWRITTEN or not shared:
        return None
    try:
        pieces = list(_written(run))
        if shared < count:
            dropped = b"," + b",".join(map(orjson.dumps, run.elements[shared:]))
            if len(pieces) > 1 and len(pieces[-1]) <= len(dropped):
                pieces = [b",".join(pieces)]  # the elements left out span pieces: cut from them joined
            last = pieces[-1]
            if len(last) <= len(dropped) or last[len(last) - len(dropped) :] != dropped:
                return None
            pieces[-1] = memoryview(last)[: len(last) - len(dropped)]
        before = orjson.dumps(items[:offset])[1:-1]
        after = orjson.dumps(items[offset + shared :])[1:-1]
    except TypeError:
        return None
    return [*((before,) if before else ()), *pieces, *((after,) if after else ())]


def dumps_body(body: dict[str, Any]) -> bytes:
    """``dumps(body)``: its tool list written from :func:`shared_json`'s bytes, an array holding a
    run from the run's (orjson places both as they are: the same bytes as writing them). The body
    is written around a slot for such an array, and the array's pieces joined into it: one copy of
    a history, however many pieces its run's bytes are kept in."""
    replaced: dict[str, Any] = {}
    tools = body.get("tools")
    if type(tools) is list:
        raw = shared_json(tools)
        if raw is not None:
            replaced["tools"] = orjson.Fragment(raw)
    arrays: list[tuple[bytes, list[Bytes]]] = []
    for key in ARRAY_KEYS:
        items = body.get(key)
        if type(items) is list and len(items) > 1:
            pieces = _array_pieces(items)
            if pieces is not None:
                replaced[key] = orjson.Fragment(_SLOTS[key])
                arrays.append((_SLOTS[key], pieces))
    if replaced:
        with contextlib.suppress(TypeError):
            return _filled(orjson.dumps({**body, **replaced}), arrays)
    return dumps(body)


def _filled(shell: bytes, arrays: list[tuple[bytes, list[Bytes]]]) -> bytes:
    """``shell`` with each slot replaced by its array, in one join."""
    if not arrays:
        return shell
    placed = sorted((shell.index(slot), slot, pieces) for slot, pieces in arrays)
    joined: list[Bytes] = []
    view, position = memoryview(shell), 0
    for at, slot, pieces in placed:
        joined += (view[position:at], b"[")
        for number, piece in enumerate(pieces):
            if number:
                joined.append(b",")
            joined.append(piece)
        joined.append(b"]")
        position = at + len(slot)
    joined.append(view[position:])
    return b"".join(joined)
