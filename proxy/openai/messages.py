"""Chat messages as the protocol defines them: their text, their roles, their identity."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

if TYPE_CHECKING:
    from array import array

import xxhash

from proxy.openai.jsoncanon import canonical_arguments

# The roles of the instructions ahead of a conversation (OpenAI's newer models say "developer").
STABLE_ROLES = frozenset({"system", "developer"})


def leading_system_count(messages: Sequence[Any], limit: int | None = None) -> int:
    """How many system (or developer) messages open ``messages``, at most ``limit``: what a client
    may write anew on every request (a clock, retrieved text) ahead of the history it re-sends as it
    was. Anything else ends them, whatever it is (a list not validated yet is read too)."""
    count = 0
    for message in messages if limit is None else islice(messages, limit):
        role = message.get("role") if isinstance(message, dict) else None
        if type(role) is not str or role not in STABLE_ROLES:
            break
        count += 1
    return count


# A message's own fields of text an engine renders beside its content: an assistant's reasoning, which
# vLLM hands to the chat template (Qwen3's, DeepSeek's render it) under either name.
REASONING_FIELDS = ("reasoning_content", "reasoning")


def part_text(part: Any) -> str | None:
    """The text of one content part: its ``text``, else the string under the key its ``type`` names,
    as vLLM reads ``{"type": "refusal", "refusal": ...}`` and ``{"type": "thinking", "thinking":
    ...}`` (and renders them as text); None for a part that is not text (an image, audio)."""
    if not isinstance(part, dict):
        return None
    text = part.get("text")
    if isinstance(text, str):
        return text
    kind = part.get("type")
    named = part.get(kind) if isinstance(kind, str) and kind != "type" else None
    return named if isinstance(named, str) else None


def message_text(message: Mapping[str, Any]) -> str:
    """All text a chat template would render for one message, concatenated: its content (every
    text-bearing part), its reasoning and its tool calls."""
    content = message.get("content")
    if isinstance(content, str) and not message.get("tool_calls") and not _reasons(message):
        return content
    parts: list[str] = []
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            text = part_text(part)
            if text is not None:
                parts.append(text)
    for field in REASONING_FIELDS:
        reasoning = message.get(field)
        if isinstance(reasoning, str):
            parts.append(reasoning)
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict):
            fn = call.get("function") or {}
            parts.append(str(fn.get("name", "")))
            parts.append(str(fn.get("arguments", "")))
    return "\n".join(parts)


def _reasons(message: Mapping[str, Any]) -> bool:
    return "reasoning_content" in message or "reasoning" in message


def is_text_parts(content: Any) -> TypeGuard[list[dict[str, Any]]]:
    """Content given as text parts only (``[{"type": "text", "text": ...}, ...]``)."""
    return (
        isinstance(content, list)
        and bool(content)
        and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
    )


# A role's bytes and the separator after them, by role (the few roles there are).
_ROLE_PREFIX: dict[str, bytes] = {}

# Shorter texts are hashed in one call with their role's bytes prepended (cheaper than a streaming
# hasher for the many short turns of a history); longer ones streamed, not copied once more.
ONE_SHOT_BYTES = 4096
# A message holding a text this long (a system prompt) has what is derived from it (its digests)
# kept by the text string's identity: relocation hands back the same stable text string on every
# request, and a prompt re-sent unchanged arrives as the string kept (``recurring``).
LONG_TEXT_CHARS = 4096


def role_prefix(role: Any) -> bytes:
    """``str(role)``'s UTF-8 bytes and a NUL: what a message's identity hashes ahead of its text."""
    prefix = _ROLE_PREFIX.get(role) if type(role) is str else None
    if prefix is None:
        prefix = str(role).encode("utf-8", "surrogatepass") + b"\x00"
        if type(role) is str and len(_ROLE_PREFIX) < 64:
            _ROLE_PREFIX[role] = prefix
    return prefix


def message_fingerprint(message: Mapping[str, Any]) -> int:
    """A 64-bit identity of what a message says (role, text, tool calls with canonical arguments),
    blind to tool-call ids and the key order of arguments."""
    prefix = role_prefix(message.get("role", ""))
    content = message.get("content")
    text = (content if isinstance(content, str) else message_text({"content": content})).encode(
        "utf-8", "surrogatepass"
    )
    calls = message.get("tool_calls")
    if not calls and len(text) < ONE_SHOT_BYTES:
        return xxhash.xxh3_64_intdigest(prefix + text)
    digest = xxhash.xxh3_64(prefix)
    digest.update(text)
    for call in calls or ():
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            function = call["function"]
            digest.update(b"\x01" + str(function.get("name", "")).encode("utf-8", "surrogatepass"))
            digest.update(canonical_arguments(function.get("arguments", "")).encode("utf-8", "surrogatepass"))
    return digest.intdigest()


_PAIR = struct.Struct("<QQ")


def link_hash(previous: int, current: int) -> int:
    """One link of a chain of 64-bit hashes: the hash of the two as 16 little-endian bytes (one
    ``struct`` call, not two ``int.to_bytes`` and a concatenation: chains run over every message
    of a history on every request)."""
    return xxhash.xxh3_64_intdigest(_PAIR.pack(previous, current))


Links = TypeVar("Links", list[int], "array[int]")


def extend_links(links: Links, digests: Iterable[int]) -> Links:
    """``links`` with one :func:`link_hash` more per digest, each on the last (in place, returned):
    ``links[k]`` names what ``links[0]`` names and the first ``k`` digests."""
    last = links[-1]
    for digest in digests:
        last = link_hash(last, digest)
        links.append(last)
    return links


def utf8_size(text: str) -> int:
    """``len(text.encode("utf-8", "surrogatepass"))`` without the copy where ``text`` is ASCII."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
