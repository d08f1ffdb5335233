"""How each protocol's answer reads: the assistant's reply (as a chat message) and its usage.

Sessions keep their history in chat form; a session that speaks another protocol renders its
requests in that protocol itself, and the runner reads the answers through these adapters.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Wire:
    name: str
    #: path under the OpenAI base URL (``.../v1``)
    path: str
    #: the request field that caps the reply
    max_tokens_key: str
    #: the assistant's reply as a chat message; raises KeyError/TypeError/IndexError if malformed
    message: Callable[[Any], dict[str, Any]]
    #: (prompt tokens, cached tokens, completion tokens), as the backend reports them
    usage: Callable[[Any], tuple[int, int, int]]


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _chat_message(payload: Any) -> dict[str, Any]:
    message = payload["choices"][0]["message"]
    if not isinstance(message, dict):
        raise TypeError("message is not an object")
    return message


def _chat_usage(payload: Any) -> tuple[int, int, int]:
    usage = payload.get("usage") if isinstance(payload, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return _int(usage.get("prompt_tokens")), _int(cached), _int(usage.get("completion_tokens"))


def _anthropic_message(payload: Any) -> dict[str, Any]:
    blocks = payload["content"]
    if not isinstance(blocks, list):
        raise TypeError("content is not an array")
    text = "".join(b["text"] for b in blocks if b.get("type") == "text")
    calls = [
        {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
        for b in blocks
        if b.get("type") == "tool_use"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _anthropic_usage(payload: Any) -> tuple[int, int, int]:
    usage = payload.get("usage") if isinstance(payload, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    read = _int(usage.get("cache_read_input_tokens"))
    prompt = _int(usage.get("input_tokens")) + read + _int(usage.get("cache_creation_input_tokens"))
    return prompt, read, _int(usage.get("output_tokens"))


def _responses_message(payload: Any) -> dict[str, Any]:
    output = payload["output"]
    if not isinstance(output, list):
        raise TypeError("output is not an array")
    text = "".join(
        part["text"]
        for item in output
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    )
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output
        if i.get("type") == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _responses_usage(payload: Any) -> tuple[int, int, int]:
    usage = payload.get("usage") if isinstance(payload, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return _int(usage.get("input_tokens")), _int(cached), _int(usage.get("output_tokens"))


CHAT = Wire("chat", "/chat/completions", "max_tokens", _chat_message, _chat_usage)
MESSAGES = Wire("messages", "/messages", "max_tokens", _anthropic_message, _anthropic_usage)
RESPONSES = Wire("responses", "/responses", "max_output_tokens", _responses_message, _responses_usage)
WIRES = {wire.name: wire for wire in (CHAT, MESSAGES, RESPONSES)}
