"""Tool definitions in one canonical order and key order.

Most chat templates render tools before the conversation, so a client that
re-sends the same tools shuffled (or with another key order) misses the cache
for the whole prompt. Sorting is lossless: the model is told the same tools.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import groupby
from typing import Any

import orjson

from proxy.canon.actions import Action
from proxy.openai.jsoncanon import canonical_dumps, sort_keys_deep


def _tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        function = tool.get("function")
        if isinstance(function, dict):
            return str(function.get("name", ""))
        if "name" in tool:
            return str(tool["name"])
    return ""


def _dumps(value: Any) -> bytes | None:
    try:
        return orjson.dumps(value)
    except TypeError:  # lone surrogates or other values orjson refuses
        return None


def canonicalize_tool_list(tools: list[Any]) -> list[Any]:
    raw = _dumps(tools)
    if raw is None:
        return _canonical_tools([sort_keys_deep(tool) for tool in tools])
    # Clients re-send the same tools on every request: canonicalize each distinct list once.
    return list(_canonical_tools_of(raw))


@lru_cache(maxsize=1024)
def _canonical_tools_of(raw: bytes) -> tuple[Any, ...]:
    sorted_keys = orjson.loads(orjson.dumps(orjson.loads(raw), option=orjson.OPT_SORT_KEYS))
    return tuple(_canonical_tools(sorted_keys))


def _canonical_tools(tools: list[Any]) -> list[Any]:
    """Order by function name; only tools sharing a name are ordered by their canonical JSON."""
    by_name = sorted(tools, key=_tool_name)
    ordered: list[Any] = []
    for _, group in groupby(by_name, key=_tool_name):
        same_name = list(group)
        ordered.extend(same_name if len(same_name) == 1 else sorted(same_name, key=canonical_dumps))
    return ordered


def canonicalize_tool_fields(body: dict[str, Any]) -> list[Action]:
    """Rewrite ``tools``, ``functions``, ``tool_choice`` and ``response_format`` in place."""
    actions: list[Action] = []
    for key in ("tools", "functions"):
        value = body.get(key)
        if isinstance(value, list) and value:
            canonical = canonicalize_tool_list(value)
            if _serialized_differently(canonical, value):
                body[key] = canonical
                actions.append(Action(f"{key}_canonicalized", str(len(value))))
    for key in ("tool_choice", "function_call", "response_format"):
        value = body.get(key)
        if isinstance(value, dict):
            canonical_value = sort_keys_deep(value)
            if _serialized_differently(canonical_value, value):
                body[key] = canonical_value
                actions.append(Action(f"{key}_canonicalized"))
    return actions


def _serialized_differently(a: Any, b: Any) -> bool:
    """Equal values may still serialize differently: dict equality ignores key order."""
    raw_a, raw_b = _dumps(a), _dumps(b)
    if raw_a is None or raw_b is None:
        return canonical_dumps(a) != canonical_dumps(b) or repr(a) != repr(b)
    return raw_a != raw_b
