"""The stable-prefix fingerprint: what routing affinity and per-prefix metrics key on."""

from __future__ import annotations

from typing import Any

import xxhash

from proxy.openai import dumps, leading_system_count, shared_dumps


def stable_prefix_hash(body: dict[str, Any], stable_count: int | None = None) -> str:
    """xxh64 over model, tools and the stable leading system messages, as forwarded."""
    messages = body.get("messages") or []
    if stable_count is None:
        stable_count = leading_system_count(messages)
    digest = xxhash.xxh3_64()
    digest.update(str(body.get("model", "")).encode("utf-8", "surrogatepass"))
    digest.update(b"\x00")
    tools = body.get("tools") or body.get("functions")
    if tools:
        digest.update(shared_dumps(tools))
    digest.update(b"\x00")
    for message in messages[:stable_count]:
        digest.update(dumps(message.get("content")))
        digest.update(b"\x00")
    return digest.hexdigest()
