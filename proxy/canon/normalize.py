"""Whitespace and Unicode normalization that cannot change meaning.

Only client-authored text is touched (system, developer, user and tool
messages); assistant messages are the model's own bytes and stay untouched.
"""

from __future__ import annotations

import unicodedata
from typing import Any

import xxhash

from proxy.recent import RecentSet

NORMALIZED_ROLES = frozenset({"system", "developer", "user", "tool"})

# Below this many characters scanning is cheaper than hashing.
MEMO_MIN_CHARS = 2048
_FLAGS = {(w, u): bytes([w * 2 + u]) for w in (False, True) for u in (False, True)}


class NormalTextMemo:
    """Long texts already seen in normal form, by xxh3-128 digest (no text is kept).

    Clients re-send the same system prompt and history on every request; scanning 30 KB
    for trailing blanks costs ~70 us, hashing it ~5 us.
    """

    def __init__(self, max_entries: int = 20_000) -> None:
        self._normal: RecentSet[bytes] = RecentSet(max_entries)

    def normalize(self, text: str, *, whitespace: bool, unicode: bool) -> str:
        if len(text) < MEMO_MIN_CHARS:
            return normalize_text(text, whitespace=whitespace, unicode=unicode)
        digest = xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass")) + _FLAGS[whitespace, unicode]
        if self._normal.touch(digest):
            return text
        normalized = normalize_text(text, whitespace=whitespace, unicode=unicode)
        if normalized == text:
            self._normal.add(digest)
        return normalized


def normalize_text(text: str, *, whitespace: bool, unicode: bool) -> str:
    if whitespace:
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        # ``"\n" in`` is a memchr; the two-character searches walk every character, so only
        # multi-line texts pay for them.
        if text.endswith((" ", "\t")) or ("\n" in text and (" \n" in text or "\t\n" in text)):
            # Line by line: a MULTILINE ``[ \t]+$`` regex rescans every run of spaces (40x slower).
            text = "\n".join(line.rstrip(" \t") for line in text.split("\n"))
    if unicode and not text.isascii():
        text = unicodedata.normalize("NFC", text)
    return text


def normalize_messages(
    messages: list[dict[str, Any]], *, whitespace: bool, unicode: bool, memo: NormalTextMemo | None = None
) -> int:
    """Normalize message texts in place; returns how many messages changed.

    ``memo`` only saves work; the result does not depend on it.
    """
    normalize = memo.normalize if memo is not None else normalize_text
    changed = 0
    for message in messages:
        if message.get("role") not in NORMALIZED_ROLES:
            continue
        content = message.get("content")
        if isinstance(content, str):
            new = normalize(content, whitespace=whitespace, unicode=unicode)
            if new != content:
                message["content"] = new
                changed += 1
        elif isinstance(content, list):
            touched = False
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    new = normalize(part["text"], whitespace=whitespace, unicode=unicode)
                    if new != part["text"]:
                        part["text"] = new
                        touched = True
            changed += touched
    return changed
