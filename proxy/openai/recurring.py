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

Found by a key made of the text's length and first and last characters (no hashing of the text),
then compared whole (a comparison of memory that stops at the first difference). Kept per tenant
(no request is faster for another tenant's text) and bounded by characters. ASCII texts gain
nothing (their UTF-8 form is the string's own memory) and short ones little: both are left alone.
"""

from __future__ import annotations

from typing import Any

from cachetools import LRUCache

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


def reuse_texts(body: dict[str, Any], namespace: str) -> None:
    """Replace the body's long non-ASCII texts seen last from this tenant by the strings kept."""
    for key in _TEXTS:
        value = body.get(key)
        if type(value) is str:
            if len(value) >= MIN_CHARS and not value.isascii():
                body[key] = _same(value, namespace)
        elif type(value) is list:
            _reuse_parts(value, namespace)
    for key in _LISTS:
        items = body.get(key)
        if type(items) is not list:
            continue
        for item in items:
            if type(item) is not dict:
                continue
            content = item.get("content")
            if type(content) is str:
                if len(content) >= MIN_CHARS and not content.isascii():
                    item["content"] = _same(content, namespace)
            elif type(content) is list:
                _reuse_parts(content, namespace)


def _reuse_parts(parts: list[Any], namespace: str) -> None:
    for part in parts:
        if type(part) is dict:
            text = part.get("text")
            if type(text) is str and len(text) >= MIN_CHARS and not text.isascii():
                part["text"] = _same(text, namespace)


def _same(text: str, namespace: str) -> str:
    key = (namespace, len(text), text[:_ENDS], text[-_ENDS:])
    known = _kept.get(key)
    if known is not None and known == text:
        return known
    if len(text) <= MAX_CHARS:
        _kept[key] = text
    return text


def forget() -> None:
    """Forget every text kept (tests, and a process that wants its memory back)."""
    _kept.clear()
