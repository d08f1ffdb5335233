"""Tool definitions in one canonical order and key order.

Most chat templates render tools before the conversation, so a client that
re-sends the same tools shuffled (or with another key order) misses the cache
for the whole prompt. Sorting is lossless: the model is told the same tools.
"""

from __future__ import annotations

from typing import Any

from proxy.canon.actions import Action
from proxy.canon.jsoncanon import canonical_dumps, sort_keys_deep


def _tool_sort_key(tool: Any) -> tuple[str, str]:
    name = ""
    if isinstance(tool, dict):
        function = tool.get("function")
        if isinstance(function, dict):
            name = str(function.get("name", ""))
        elif "name" in tool:
            name = str(tool["name"])
    return name, canonical_dumps(tool)


def canonicalize_tool_list(tools: list[Any]) -> list[Any]:
    return sorted((sort_keys_deep(tool) for tool in tools), key=_tool_sort_key)


def canonicalize_tool_fields(body: dict[str, Any]) -> list[Action]:
    """Rewrite ``tools``, ``functions``, ``tool_choice`` and ``response_format`` in place."""
    actions: list[Action] = []
    for key in ("tools", "functions"):
        value = body.get(key)
        if isinstance(value, list) and value:
            canonical = canonicalize_tool_list(value)
            if canonical != value or _key_orders_differ(canonical, value):
                body[key] = canonical
                actions.append(Action(f"{key}_canonicalized", str(len(value))))
    for key in ("tool_choice", "function_call", "response_format"):
        value = body.get(key)
        if isinstance(value, dict):
            canonical_value = sort_keys_deep(value)
            if _key_orders_differ(canonical_value, value):
                body[key] = canonical_value
                actions.append(Action(f"{key}_canonicalized"))
    return actions


def _key_orders_differ(a: Any, b: Any) -> bool:
    """Equal values may still serialize differently: dict equality ignores key order."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return True
        return any(_key_orders_differ(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) != len(b) or any(_key_orders_differ(x, y) for x, y in zip(a, b, strict=True))
    return a != b
