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
