"""What ``/v1/messages`` and ``/v1/responses`` share: vLLM serves both as a chat completion.

The request's sampling fields go into a chat request, the chat answer's stream is read back
chunk by chunk, and its usage tells how much of the prompt this request wrote to the cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def copy_fields(
    body: dict[str, Any], chat: dict[str, Any], renamed: tuple[str, str], stream_options: dict[str, bool]
) -> None:
    """Into ``chat``: the fields set in ``body`` that the chat request takes as they are
    (``renamed``: one it takes under another name), and streaming with ``stream_options``."""
    for key, target in (
        renamed,
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("cache_salt", "cache_salt"),
        ("fake_options", "fake_options"),
    ):
        if body.get(key) is not None:
            chat[target] = body[key]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = stream_options


def stream_chunks(raw: Any) -> Iterator[dict[str, Any] | None]:
    """The chat completion chunks in one piece of a chat SSE body; None for ``[DONE]``."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    for line in text.split("\n"):
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        yield None if data == "[DONE]" else json.loads(data)


def cache_write_tokens(prompt_tokens: int, cached_tokens: int, block_size: int) -> int:
    """The prompt's full blocks this request computed (and cached): what vLLM reports as written."""
    return max(0, prompt_tokens // block_size * block_size - cached_tokens)
