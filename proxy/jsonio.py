"""Fast JSON on the hot path: orjson, with the standard library where orjson is stricter.

orjson refuses a few things a client may send (lone surrogate escapes, and the
``NaN``/``Infinity`` literals Python's json accepts); those fall back to ``json``
so no request is refused that the upstream would take. (orjson reads an integer
beyond 64 bits as a float; no OpenAI parameter carries one.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson


def loads(raw: bytes | str) -> Any:
    """Parse JSON; raises ``ValueError`` (``json``'s own message) when it is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """Compact JSON bytes (UTF-8; where orjson refuses a value, ASCII with ``\\u`` escapes)."""
    try:
        return orjson.dumps(value, default=default)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), default=default).encode()
