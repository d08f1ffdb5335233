"""Token estimates for text the backend has not reported on yet.

The backend's ``usage`` is ground truth; this is the local estimate used before a
request is sent (budgets, compaction decisions). Counts are memoized by an xxhash
of the text so a long history is tokenized once, not on every turn.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash
from cachetools import LRUCache

from proxy.openai import message_text
from proxy.tokenization.encoding import load_encoding

# Tokens per byte of a request before the backend has reported on its conversation: typical for
# text in a BPE vocabulary (about four bytes a token), for what is reported as saved; cautious (it
# overestimates), for what must stay within a limit.
TYPICAL_TOKENS_PER_BYTE = 0.25
CAUTIOUS_TOKENS_PER_BYTE = 0.5

# Chat templates wrap every message in a few control tokens (role header, end marker).
PER_MESSAGE_OVERHEAD = 4


class TokenCounter:
    """Counts tokens of strings and chat messages with a bounded memo."""

    def __init__(self, max_entries: int = 65536) -> None:
        self._memo: LRUCache[int, int] = LRUCache(max_entries)

    def count_text(self, text: str) -> int:
        if not text:
            return 0
        key = xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))
        cached = self._memo.get(key)
        if cached is not None:
            return cached
        # The encoding (cached by load_encoding) loads with the first exact count: about 35 MiB and
        # 0.2 s that a process whose requests never come near a limit (the byte estimate decides
        # alone there) does not spend.
        count = len(load_encoding().encode_ordinary(text))
        self._memo[key] = count
        return count

    def count_message(self, message: dict[str, Any]) -> int:
        return PER_MESSAGE_OVERHEAD + self.count_text(message_text(message))

    def count_messages(self, messages: list[dict[str, Any]]) -> int:
        return sum(self.count_message(m) for m in messages)

    def count_tools(self, tools: list[Any] | None) -> int:
        if not tools:
            return 0
        return self.count_text(json.dumps(tools, ensure_ascii=False, separators=(",", ":")))
