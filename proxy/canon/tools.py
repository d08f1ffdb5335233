"""Tool definitions in one canonical order and key order, for apps seen to reorder them.

Most chat templates render tools before the conversation, so a client that
re-sends the same tools shuffled (or with another key order) misses the cache
for the whole prompt. Sorting is lossless: the model is told the same tools.

Most clients, coding agents among them, send their tools in one fixed order, and
re-sorting those (and their schema keys) only changes what the model reads and how
many tokens it costs (a sorted Bash tool's parameters tokenize differently). So
with a memory (:class:`ToolOrders`), a field is rewritten only for an app whose
value of that field was seen to arrive in another order or key order with the same
content: its first appearance, and every app that never varies, goes as sent.
Without a memory (a stateless call), every field is put in canonical form.
"""

from __future__ import annotations

import copy
from itertools import groupby
from typing import Any

import orjson
import xxhash
from cachetools import LRUCache, TTLCache

from proxy.canon.actions import Action
from proxy.openai import canonical_dumps, shared_json, sort_keys_deep


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


# Canonical forms by the digest of the bytes sent: bounded by what they hold (a parsed tool list
# holds about four times its JSON), and released once idle (a list not re-sent for CANONICAL_IDLE_S).
CANONICAL_FORMS_BYTES = 32 * 1024 * 1024
CANONICAL_IDLE_S = 600.0
_canonical_forms: TTLCache[tuple[int, int], tuple[Any, int, int]] = TTLCache(
    CANONICAL_FORMS_BYTES, CANONICAL_IDLE_S, getsizeof=lambda entry: entry[2]
)


def _canonical_form(raw: bytes) -> tuple[Any, int]:
    """The canonical form of a serialized field (tools as a tuple, in canonical order; keys sorted
    at every level), and the hash of its serialization. Clients re-send the same tools on every
    request: each distinct value is canonicalized once while it is in use."""
    key = (len(raw), xxhash.xxh3_64_intdigest(raw))
    found = _canonical_forms.get(key)
    if found is None:
        value = orjson.loads(orjson.dumps(orjson.loads(raw), option=orjson.OPT_SORT_KEYS))
        canonical: Any = tuple(_canonical_tools(value)) if isinstance(value, list) else value
        dumped = orjson.dumps(list(canonical) if isinstance(canonical, tuple) else canonical)
        found = (canonical, xxhash.xxh3_64_intdigest(dumped), 4 * len(raw) + 256)
    if found[2] <= CANONICAL_FORMS_BYTES:
        _canonical_forms[key] = found  # written on a hit too: its idle time starts again
    return found[0], found[1]


def expire_idle() -> None:
    """Release the canonical forms no request used for ``CANONICAL_IDLE_S`` (a periodic task's call:
    an idle cache is never touched otherwise)."""
    _canonical_forms.expire()


def _canonical_tools(tools: list[Any]) -> list[Any]:
    """Order by function name; only tools sharing a name are ordered by their canonical JSON."""
    by_name = sorted(tools, key=_tool_name)
    ordered: list[Any] = []
    for _, group in groupby(by_name, key=_tool_name):
        same_name = list(group)
        ordered.extend(same_name if len(same_name) == 1 else sorted(same_name, key=canonical_dumps))
    return ordered


class ToolOrders:
    """The first byte form seen of each app's field, which the same content in another order or
    key order is given back as.

    An app's field is identified by tenant, model, field and the names it carries (a tool set
    that grows is another field value, first seen as sent). The first form is the reference: a
    client that always sends it is forwarded as sent, and one that reorders is forwarded in it,
    byte for byte what the backend was sent before, from its first request on (no conversation
    in flight sees its tools change). Content that changed (an edited description) becomes the
    new reference. Bounded by the bytes kept, least recently used out.
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._seen: LRUCache[int, tuple[int, int, bytes]] = LRUCache(max_bytes, getsizeof=_entry_size)

    def reference(self, key: int, raw: bytes, sent: int, canonical: int) -> bytes | None:
        """Record one value (``raw``, hashed as sent and in canonical form); the reference form to
        forward instead, or None to forward it as sent."""
        known = self._seen.get(key)
        if known is not None and known[1] == canonical:
            return None if known[0] == sent else known[2]
        self.store(key, sent, canonical, raw)
        return None

    def store(self, key: int, sent: int, canonical: int, raw: bytes) -> None:
        """Make ``raw`` the field's reference form (what another replica shares goes through here)."""
        if len(raw) + ENTRY_OVERHEAD <= self._seen.maxsize:
            self._seen[key] = (sent, canonical, raw)

    def known(self, key: int) -> tuple[int, int] | None:
        """The field's reference, as (hash as sent, canonical hash), if any."""
        entry = self._seen.get(key)
        return None if entry is None else (entry[0], entry[1])

    def __len__(self) -> int:
        return len(self._seen)


ENTRY_OVERHEAD = 128


def _entry_size(entry: tuple[int, int, bytes]) -> int:
    return len(entry[2]) + ENTRY_OVERHEAD


def canonicalize_tool_fields(
    body: dict[str, Any], orders: ToolOrders | None = None, namespace: str = ""
) -> list[Action]:
    """Rewrite ``tools``, ``functions``, ``tool_choice`` and ``response_format`` in place: without
    ``orders``, into canonical form; with it, into the app's reference form (``namespace``: the
    tenant), which for a client that does not vary is what it sent."""
    actions: list[Action] = []
    for key in ("tools", "functions"):
        value = body.get(key)
        if isinstance(value, list) and value:
            rewritten = _rewritten(orders, namespace, body, key, value)
            if rewritten is not None:
                body[key] = rewritten
                actions.append(Action(f"{key}_canonicalized", str(len(value))))
    for key in ("tool_choice", "function_call", "response_format"):
        value = body.get(key)
        if isinstance(value, dict):
            rewritten = _rewritten(orders, namespace, body, key, value)
            if rewritten is not None:
                body[key] = rewritten
                actions.append(Action(f"{key}_canonicalized"))
    return actions


def _rewritten(orders: ToolOrders | None, namespace: str, body: dict[str, Any], field: str, value: Any) -> Any:
    """The field's value to forward, or None when it goes as sent."""
    raw = shared_json(value) if type(value) is list else _dumps(value)
    if raw is None:  # values orjson refuses: canonical, as without a memory
        canonical: Any = (
            _canonical_tools([sort_keys_deep(t) for t in value]) if isinstance(value, list) else sort_keys_deep(value)
        )
        return canonical if _serialized_differently(canonical, value) else None
    # Clients re-send the same tools on every request: one dump and one hash per request.
    sent = xxhash.xxh3_64_intdigest(raw)
    canonical_value, canonical_digest = _canonical_form(raw)
    if orders is None:
        return _thawed(canonical_value) if sent != canonical_digest else None
    model = str(body.get("model", ""))
    # The key is a function of the bytes sent (hashed as ``sent``): a re-sent list is not walked for it again.
    found = (namespace, model, field, sent)
    key = _FIELD_KEYS.get(found)
    if key is None:
        key = _FIELD_KEYS[found] = _field_key(namespace, model, field, value)
    reference = orders.reference(key, raw, sent, canonical_digest)
    return None if reference is None else _parsed(reference)


# Field keys by (tenant, model, field, hash of the value's bytes): an app's tools, re-sent on every request.
_FIELD_KEYS: LRUCache[tuple[str, str, str, int], int] = LRUCache(4096)


def _thawed(value: Any) -> Any:
    """A cached canonical value, as the request's own (the tools' list is new; an object field,
    small, is copied whole)."""
    return list(value) if isinstance(value, tuple) else copy.deepcopy(value)


def _parsed(raw: bytes) -> Any:
    """The reference form, parsed afresh: nothing in a request may alias a kept value."""
    return orjson.loads(raw)


def _field_key(namespace: str, model: str, field: str, value: Any) -> int:
    """An app's field: tenant, model, field, the shape of its entries and the names it carries."""
    names = sorted(_tool_name(t) for t in value) if isinstance(value, list) else []
    shape = sorted(value[0]) if isinstance(value, list) and isinstance(value[0], dict) else []
    parts = [namespace, model, field, *shape, "\x01", *names]
    return xxhash.xxh3_64_intdigest("\x00".join(parts).encode("utf-8", "surrogatepass"))


def _serialized_differently(a: Any, b: Any) -> bool:
    """Equal values may still serialize differently: dict equality ignores key order."""
    raw_a, raw_b = _dumps(a), _dumps(b)
    if raw_a is None or raw_b is None:
        return canonical_dumps(a) != canonical_dumps(b) or repr(a) != repr(b)
    return raw_a != raw_b
