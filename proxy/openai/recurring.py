"""Texts a tenant sends again, handed back as the strings already made.

Every request is parsed afresh, so a system prompt sent on every request arrives as a new string
each time. Where that string is not ASCII (a Chinese or Japanese prompt, a prompt with typographic
quotes), everything the proxy does with its bytes starts with converting it to UTF-8: orjson's
first serialization of a 23k-character CJK prompt costs about eight times one that finds the form
made, and CPython keeps that form with the string. So the long non-ASCII texts of a request (the
messages' contents and text parts, the system prompt and instructions) that equal the last text of
the same tenant, length and ends are replaced, in the parsed body, by that text's string: equal
strings are interchangeable, so nothing forwarded or answered changes, and the second request of a
prompt converts nothing.

A conversation's history is looked into once: the messages its last request sent too (found by
``proxy.openai.continuation``) are looked into again only where they hold such a text.

Relocation hands its stable texts through the same memory (``same_text``, scoped by the place): a
clock moved out of an unchanged prompt leaves the same stable text on every request, and its string
is the one made the first time. Found by a key made of the text's length and first and last
characters (no hashing of the text), then compared whole (a comparison of memory that stops at
the first difference). Kept per tenant (no request is faster for another tenant's text) and
bounded by characters. ASCII texts gain nothing (their UTF-8 form is the string's own memory) and
short ones little: both are left alone.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Generic, TypeVar

from cachetools import LRUCache

from proxy.openai.continuation import Continuations
from proxy.openai.messages import STABLE_ROLES

V = TypeVar("V")

# Shorter texts cost little to convert; ASCII ones nothing.
MIN_CHARS = 1024
# The characters of the texts kept, all tenants together: a few dozen long prompts.
MAX_CHARS = 4_000_000
# The ends that, with the length, name a text (a template's filled lines usually sit inside).
_ENDS = 48

# The keys under which a body holds the texts of its messages or instructions (chat, Anthropic
# Messages, Responses): a list of messages or items, or a string, or a list of text parts.
_LISTS = ("messages", "input")
_TEXTS = ("system", "instructions")

_kept: LRUCache[tuple[str, int, str, str], str] = LRUCache(MAX_CHARS, getsizeof=len)


# Per tenant and conversation, the messages after the leading system ones that the last request
# sent, with the places among them of those that hold a long non-ASCII text: the next request looks
# into only those and the messages it adds.
_LOOKED: Continuations[tuple[int, ...]] = Continuations()


def reuse_texts(body: dict[str, Any], namespace: str) -> None:
    """Replace the body's long non-ASCII texts seen last from this tenant by the strings kept."""
    for key in _TEXTS:
        _reuse_in(body, key, namespace)
    for key in _LISTS:
        items = body.get(key)
        if type(items) is list:
            _reuse_in_items(items, key, namespace)


def _reuse_in_items(items: list[Any], key: str, namespace: str) -> None:
    """The texts of a list of messages (or items): its leading system messages, then those of its
    history that the conversation's last request found long and not ASCII, and what it adds."""
    start = 0
    for item in items:
        # (a role of any JSON type: validation, which names it, comes after)
        if type(item) is not dict or type(item.get("role")) is not str or item["role"] not in STABLE_ROLES:
            break
        _reuse_in(item, "content", namespace)
        start += 1
    history = items[start:]
    resumed = _LOOKED.resume(namespace, history, key)
    shared = resumed.shared if resumed.state is not None else 0
    held = [index for index in resumed.state or () if index < shared]
    for index in held:
        _reuse_in(history[index], "content", namespace)
    for index in range(shared, len(history)):
        item = history[index]
        if type(item) is dict and _reuse_in(item, "content", namespace):
            held.append(index)
    resumed.keep(history, tuple(held))


def same_text(text: str, scope: str) -> str:
    """The string kept under ``scope`` (a tenant, or a place of one) that equals ``text``, where
    ``text`` is long and not ASCII and one is kept; else ``text``, kept for the next."""
    if len(text) < MIN_CHARS or text.isascii():
        return text
    key = (scope, len(text), text[:_ENDS], text[-_ENDS:])
    known = _kept.get(key)
    if known is not None and known == text:
        return known
    if len(text) <= MAX_CHARS:
        _kept[key] = text
    return text


def _reuse_in(container: dict[str, Any], key: str, namespace: str) -> bool:
    """The text at ``container[key]``, or each text part's text where it holds a list of parts;
    whether one is long and not ASCII (kept)."""
    value = container.get(key)
    if type(value) is str:
        container[key] = same_text(value, namespace)
        return _kept_kind(value)
    held = False
    if type(value) is list:
        for part in value:
            if type(part) is dict and type(text := part.get("text")) is str:
                part["text"] = same_text(text, namespace)
                held = held or _kept_kind(text)
    return held


def _kept_kind(text: str) -> bool:
    return len(text) >= MIN_CHARS and not text.isascii()


class ByText(Generic[V]):
    """What a step derived from a long text string (its message's digest), found again by the
    string's identity: the stable text relocation hands back (``same_text``) and a prompt re-sent
    unchanged (``reuse_texts``) are the same string on every request, so the step runs once per
    string. Each entry holds its string (its id stays its own while kept) and what else the value
    depends on (``extra``, compared with ``==``); bounded by the characters held, least recently
    used out. Kept per process, as the strings are: a string is one tenant's (``reuse_texts`` and
    ``same_text`` keep them per tenant)."""

    def __init__(self, max_chars: int = MAX_CHARS) -> None:
        self._memo: LRUCache[int, tuple[str, Hashable, V]] = LRUCache(max_chars, getsizeof=_text_chars)

    def get(self, text: str, extra: Hashable) -> V | None:
        known = self._memo.get(id(text))
        if known is None or known[0] is not text or known[1] != extra:
            return None
        return known[2]

    def put(self, text: str, extra: Hashable, value: V) -> None:
        if len(text) < self._memo.maxsize:
            self._memo[id(text)] = (text, extra, value)


def _text_chars(entry: tuple[str, Hashable, Any]) -> int:
    return len(entry[0]) + 1


def forget() -> None:
    """Forget every text kept (tests, and a process that wants its memory back)."""
    _kept.clear()
