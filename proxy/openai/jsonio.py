"""Fast JSON on the hot path: orjson, with the standard library where orjson is stricter.

orjson refuses a few things a client may send (lone surrogate escapes, and the
``NaN``/``Infinity`` literals Python's json accepts); those fall back to ``json``
so no request is refused that the upstream would take. (orjson reads an integer
beyond 64 bits as a float; no OpenAI parameter carries one.)

Nesting is bounded: orjson refuses to parse past 1024 levels and to serialize
past 254, and the standard library recurses once per level, so a document a
few hundred levels deep would otherwise fail somewhere deep inside the proxy
(a ``RecursionError``) instead of at the door.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import chain, compress, repeat
from operator import is_
from typing import Any

import orjson
import xxhash
from cachetools import LRUCache, TTLCache

# Far deeper than any real request (JSON schemas of tools nest a dozen levels), far below the
# 254 levels orjson serializes and the interpreter's recursion limit.
MAX_DEPTH = 64


class TooDeep(ValueError):
    """A JSON document nests deeper than :data:`MAX_DEPTH`."""


def loads(raw: bytes | str, max_depth: int | None = None) -> Any:
    """Parse JSON; raises ``ValueError`` (``json``'s own message) when it is not JSON, and
    :class:`TooDeep` when ``max_depth`` is given and the document nests deeper."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            value = json.loads(raw)
        except RecursionError:
            raise TooDeep(f"JSON nests deeper than {max_depth or MAX_DEPTH} levels") from None
    if max_depth is not None:
        check_depth(value, max_depth)
    return value


# What parsed JSON holds: a level of only these is walked without a Python step per value.
_PLAIN = frozenset({dict, list, str, int, float, bool, type(None)})


def check_depth(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise :class:`TooDeep` if ``value`` nests arrays or objects more than ``max_depth`` levels.

    Level by level (no recursion), so the check itself cannot overflow the interpreter's stack.
    """
    if type(value) not in (dict, list):
        if isinstance(value, dict | list):
            _check_depth(value, max_depth)  # a subclass
        return
    dicts: list[Any] = [value] if type(value) is dict else []
    lists: list[Any] = [value] if type(value) is list else []
    depth = 0
    while dicts or lists:
        depth += 1
        if depth > max_depth:
            raise TooDeep(f"JSON nests deeper than {max_depth} levels")
        children = list(chain(chain.from_iterable(map(dict.values, dicts)), chain.from_iterable(lists)))
        types = list(map(type, children))
        if not _PLAIN.issuperset(types):
            break  # something else than parsed JSON holds: the general walk below
        dicts = list(compress(children, map(is_, types, repeat(dict))))
        lists = list(compress(children, map(is_, types, repeat(list))))
    else:
        return
    _check_depth(value, max_depth)


# Values found within a depth bound, by (tenant, bound, digest of their JSON): a tool list, which a
# client re-sends on every request, is walked once per tenant instead of on every request.
_WITHIN_BOUND: LRUCache[tuple[str, int, int], None] = LRUCache(4096)


def check_depth_once(value: list[Any], namespace: str, max_depth: int = MAX_DEPTH) -> None:
    """:func:`check_depth`, once per ``namespace`` (the tenant: no tenant's request is checked faster
    for another's) and distinct list: a list seen within the bound before costs a hash of its bytes,
    which :func:`shared_json` makes once for every step of the request that writes the list (a tool
    list's walk costs five to eight times its serialization).

    Keyed by orjson's bytes of the list, which fix its nesting exactly (orjson writes NaN as
    ``null``, a leaf either way). A list orjson refuses to write (a lone surrogate, an integer past
    64 bits, nesting past its 254 levels) is walked every time."""
    raw = shared_json(value)
    if raw is None:
        check_depth(value, max_depth)
        return
    key = (namespace, max_depth, xxhash.xxh3_128_intdigest(raw))
    if key not in _WITHIN_BOUND:
        check_depth(value, max_depth)
    _WITHIN_BOUND[key] = None  # written on a hit too: the least recently used goes first


def _check_depth(value: Any, max_depth: int) -> None:
    level: list[Any] = [value] if isinstance(value, dict | list) else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            raise TooDeep(f"JSON nests deeper than {max_depth} levels")
        below: list[Any] = []
        for item in level:
            for child in item.values() if isinstance(item, dict) else item:
                if isinstance(child, dict | list):
                    below.append(child)
        level = below


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """Compact JSON bytes (UTF-8; where orjson refuses a value, ASCII with ``\\u`` escapes)."""
    try:
        return orjson.dumps(value, default=default)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), default=default).encode()


# orjson's bytes of the lists that several steps of one request serialize (a tool list: its
# canonical form, the layout's chain header, the prefix fingerprint, the budget, the digests and
# the body sent upstream), by identity: the list held, so that its id stays its own, with its items.
# Only the requests in flight need theirs: bounded by what the entries hold (a parsed list about
# four times its JSON, and the JSON), released once idle (SHARED_IDLE_S without a request's use).
SHARED_BYTES = 16 * 1024 * 1024
# The least memory a bytes object orjson returns holds (its writing buffer), whatever its length.
ORJSON_BUFFER_BYTES = 4096
SHARED_IDLE_S = 60.0
_SHARED: TTLCache[int, tuple[list[Any], tuple[Any, ...], bytes | None]] = TTLCache(
    SHARED_BYTES, SHARED_IDLE_S, getsizeof=lambda entry: 5 * len(entry[2] or b"") + 64 * len(entry[1]) + 256
)


def shared_json(value: list[Any]) -> bytes | None:
    """``orjson.dumps(value)`` (None where orjson refuses it), made once per list object.

    Nothing on the hot path changes a request's tool list in place: a step that changes tools
    forwards a new list (``proxy.canon.tools``, the protocol views), so the bytes made for a list
    stay its bytes. A list changed item by item (another item, a reorder) is written afresh; an
    item changed in place would not be seen, which is why only lists pass through here."""
    found = _SHARED.get(id(value))
    if found is not None and found[0] is value and len(found[1]) == len(value) and all(map(is_, found[1], value)):
        return found[2]
    try:
        raw: bytes | None = orjson.dumps(value)
    except TypeError:
        raw = None
    if raw is not None and len(raw) < ORJSON_BUFFER_BYTES:
        # orjson's output holds the buffer it was written in (4 KiB at least) however short it is:
        # kept, a short one is copied to its own size (a tool-less request's "[]" held 4 KiB).
        raw = bytes(memoryview(raw))
    entry = (value, tuple(value), raw)
    if _SHARED.getsizeof(entry) <= SHARED_BYTES:
        _SHARED[id(value)] = entry
    return raw


def expire_idle() -> None:
    """Release the lists no request used for ``SHARED_IDLE_S`` (a periodic task's call)."""
    _SHARED.expire()


def shared_dumps(value: Any) -> bytes:
    """:func:`dumps`, through :func:`shared_json` for a list."""
    raw = shared_json(value) if type(value) is list else None
    return raw if raw is not None else dumps(value)
