"""Canonical JSON: one byte form for every value, whatever key order a client used."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

from proxy.openai.memo import ARGUMENTS_MEMO_CHARS, memo_by_text

_orjson: ModuleType | None
try:
    import orjson as _orjson
except ImportError:  # the real engine's venv imports this module (testbed's replies) without it
    _orjson = None


def sort_keys_deep(value: Any) -> Any:
    """The same value with every object's keys in sorted order (list order kept).

    Through orjson where it round-trips the value exactly (what it cannot serialize, or serializes
    as something else, such as ``NaN`` as ``null``, is sorted in Python): a tool's JSON schema is
    sorted in C, not one call per node."""
    if _orjson is not None and isinstance(value, dict | list):
        try:
            sorted_value = _orjson.loads(_orjson.dumps(value, option=_orjson.OPT_SORT_KEYS))
        except (TypeError, _orjson.JSONDecodeError):
            pass
        else:
            if sorted_value == value:
                return sorted_value
    return _sort_keys_deep(value)


def _sort_keys_deep(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sort_keys_deep(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sort_keys_deep(item) for item in value]
    return value


def canonical_dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def canonical_arguments(arguments: Any) -> str:
    """A tool call's arguments in canonical form; non-JSON strings stay as they are."""
    if isinstance(arguments, str):
        return _canonical_argument_string(arguments)
    return canonical_dumps(arguments)


@memo_by_text(ARGUMENTS_MEMO_CHARS)
def _canonical_argument_string(arguments: str) -> str:
    # History re-sends the same argument strings on every turn: parse each one once.
    try:
        return canonical_dumps(json.loads(arguments))
    except ValueError:
        return arguments
