"""Canonical JSON: one byte form for every value, whatever key order a client used."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any


def sort_keys_deep(value: Any) -> Any:
    """The same value with every object's keys in sorted order (list order kept)."""
    if isinstance(value, dict):
        return {key: sort_keys_deep(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [sort_keys_deep(item) for item in value]
    return value


def canonical_dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def canonical_arguments(arguments: Any) -> str:
    """A tool call's arguments in canonical form; non-JSON strings stay as they are."""
    if isinstance(arguments, str):
        return _canonical_argument_string(arguments)
    return canonical_dumps(arguments)


@lru_cache(maxsize=65536)
def _canonical_argument_string(arguments: str) -> str:
    # History re-sends the same argument strings on every turn: parse each one once.
    try:
        return canonical_dumps(json.loads(arguments))
    except ValueError:
        return arguments
