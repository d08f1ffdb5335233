"""``/v1/messages`` as vLLM 0.32 serves it: converted to a chat completion and back.

Mirrors ``vllm/entrypoints/anthropic/serving.py``: the request becomes a chat request (system
blocks joined with nothing between them, Claude Code's billing-header block dropped, inline
system messages kept in place or merged into the leading one for templates that refuse them,
``tool_result`` blocks as ``tool`` messages ahead of the user's text, ``tool_use`` as tool calls
with ``json.dumps(input)`` arguments); the chat answer becomes an Anthropic message, a chat
stream becomes Anthropic's typed events. Usage as vLLM builds it: ``input_tokens`` excludes
``cache_read_input_tokens`` (cached blocks) and ``cache_creation_input_tokens`` (full blocks of
the prompt this request computed and cached); ``message_start`` carries only the prompt total.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from testbed.fakevllm.via_chat import cache_write_tokens, copy_fields, stream_chunks

BILLING_HEADER = "x-anthropic-billing-header"


def error_response(status: int, message: str, err_type: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": err_type, "message": message}}, status_code=status)


def from_chat_error(status: int, body: bytes) -> JSONResponse:
    """vLLM's ``translate_error_response``: the chat layer's error, in Anthropic's shape."""
    try:
        error = json.loads(body)["error"]
        return error_response(status, str(error["message"]), str(error["type"]))
    except (ValueError, KeyError, TypeError):
        return error_response(status, "error", "Error")


# -- request ---------------------------------------------------------------------------------


def to_chat(body: dict[str, Any], *, merge_inline_system: bool, count_tokens: bool = False) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    system_parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str) and system:
        system_parts.append(system)
    elif isinstance(system, list):
        system_parts.extend(_system_texts(system))
    if merge_inline_system:
        for message in body.get("messages") or []:
            if isinstance(message, dict) and message.get("role") == "system":
                text = _inline_system_text(message.get("content"))
                if text:
                    system_parts.append(text)
    if system_parts:
        messages.append({"role": "system", "content": "".join(system_parts)})
    for message in body.get("messages") or []:
        _convert_message(message, messages, merge_inline_system)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if not count_tokens:
        chat["max_tokens"] = body.get("max_tokens")
        copy_fields(body, chat, ("stop_sequences", "stop"), {"include_usage": True, "continuous_usage_stats": True})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind)) or {
            "type": "function",
            "function": {"name": choice.get("name")},
        }
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.get("name"),
                    "description": tool.get("description"),
                    "parameters": tool.get("input_schema"),
                },
            }
            for tool in tools
            if isinstance(tool, dict)
        ]
        chat.setdefault("tool_choice", "auto")
    return chat


def _system_texts(blocks: list[Any]) -> list[str]:
    return [
        b["text"]
        for b in blocks
        if isinstance(b, dict)
        and b.get("type") == "text"
        and isinstance(b.get("text"), str)
        and b["text"]
        and not b["text"].startswith(BILLING_HEADER)
    ]


def _inline_system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    if isinstance(content, list):
        return "".join(_system_texts(content)) or None
    return None


def _convert_message(message: Any, out: list[dict[str, Any]], merge_inline_system: bool) -> None:
    if not isinstance(message, dict):
        return
    role, content = message.get("role"), message.get("content")
    if role == "system":
        if not merge_inline_system and (text := _inline_system_text(content)):
            out.append({"role": "system", "content": text})
        return
    converted: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        converted["content"] = content
        out.append(converted)
        return
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    for block in content or []:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("source"), dict):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "tool_use":
            tool_calls.append(
                {
                    "id": block.get("id") or "call_0",
                    "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})},
                }
            )
        elif kind == "tool_result":
            if role == "user":
                out.append(
                    {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": _tool_text(block)}
                )
            else:
                parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    if tool_calls:
        converted["tool_calls"] = tool_calls
    if parts:
        converted["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if not (role == "user" and "content" not in converted):
        out.append(converted)


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(i.get("text", "")) for i in content if isinstance(i, dict) and i.get("type") == "text")
    return ""


# -- answer ----------------------------------------------------------------------------------


def usage(chat_usage: dict[str, Any] | None, block_size: int, details: bool) -> dict[str, Any]:
    """vLLM's ``_build_anthropic_usage`` of a chat usage (``details``: --enable-prompt-tokens-details)."""
    if not chat_usage:
        return {"input_tokens": 0, "output_tokens": 0}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    out: dict[str, Any] = {"input_tokens": prompt, "output_tokens": int(chat_usage.get("completion_tokens") or 0)}
    if details:
        prompt_details = chat_usage.get("prompt_tokens_details") or {}
        read = int(prompt_details.get("cached_tokens") or 0)
        created = cache_write_tokens(prompt, read, block_size)
        out["input_tokens"] = max(0, prompt - read - created)
        out["cache_creation_input_tokens"] = created
        out["cache_read_input_tokens"] = read
    return out


def stop_reason(finish_reason: str | None, tool_used: bool) -> str | None:
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason not in ("stop", "tool_calls"):
        return None
    return "tool_use" if tool_used or finish_reason == "tool_calls" else "end_turn"


def message(chat: dict[str, Any], block_size: int, details: bool) -> dict[str, Any]:
    choice = chat["choices"][0]
    reply = choice["message"]
    content: list[dict[str, Any]] = []
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    calls = reply.get("tool_calls") or []
    for call in calls:
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
        )
    if not content:
        content.append({"type": "text", "text": ""})
    return {
        "id": chat["id"],
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": chat["model"],
        "stop_reason": stop_reason(choice.get("finish_reason"), bool(calls)),
        "usage": usage(chat.get("usage"), block_size, details),
    }


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def stream(chunks: AsyncIterable[Any], block_size: int, details: bool) -> AsyncIterator[str]:
    """vLLM's ``message_stream_converter`` over a chat completion stream."""
    index = 0
    block_type: str | None = None
    tool_id: str | None = None
    ids_by_index: dict[int, str] = {}
    finish_reason: str | None = None
    tool_used = False
    first = True

    def stop_block() -> list[str]:
        nonlocal block_type, tool_id, index
        if block_type is None:
            return []
        events = [_event("content_block_stop", {"type": "content_block_stop", "index": index})]
        block_type, tool_id = None, None
        index += 1
        return events

    def start_block(block: dict[str, Any]) -> str:
        nonlocal block_type, tool_id
        block_type = block["type"]
        tool_id = block.get("id") if block["type"] == "tool_use" else None
        return _event("content_block_start", {"type": "content_block_start", "content_block": block, "index": index})

    async for raw in chunks:
        for chunk in stream_chunks(raw):
            if chunk is None:  # [DONE]
                for event in stop_block():
                    yield event
                yield _event("message_stop", {"type": "message_stop"})
                continue
            if first:
                first = False
                prompt = int((chunk.get("usage") or {}).get("prompt_tokens") or 0)
                start = {
                    "id": chunk["id"],
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": chunk["model"],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": prompt, "output_tokens": 0},
                }
                yield _event("message_start", {"type": "message_start", "message": start})
                continue
            if not chunk.get("choices"):
                for event in stop_block():
                    yield event
                stop = {"stop_reason": stop_reason(finish_reason or "stop", tool_used), "stop_sequence": None}
                final = {
                    "type": "message_delta",
                    "delta": stop,
                    "usage": usage(chunk.get("usage"), block_size, details),
                }
                yield _event("message_delta", final)
                continue
            choice = chunk["choices"][0]
            if choice.get("finish_reason") is not None:
                finish_reason = choice["finish_reason"]
            delta: dict[str, Any] = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                if block_type != "text":
                    for event in stop_block():
                        yield event
                    yield start_block({"type": "text", "text": ""})
                payload: dict[str, Any] = {
                    "type": "content_block_delta",
                    "delta": {"type": "text_delta", "text": content},
                    "index": index,
                }
                yield _event("content_block_delta", payload)
            calls: list[dict[str, Any]] = list(delta.get("tool_calls") or [])
            for call in calls:
                function: dict[str, Any] = call.get("function") or {}
                if call.get("id") is not None:
                    ids_by_index[call.get("index", 0)] = call["id"]
                    if tool_id != call["id"] and function.get("name") is not None:
                        for event in stop_block():
                            yield event
                        tool_used = True
                        yield start_block({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
                    current = call["id"]
                else:
                    current = ids_by_index.get(call.get("index", 0))
                if function.get("arguments") and current is not None and tool_id == current:
                    json_delta: dict[str, Any] = {
                        "type": "content_block_delta",
                        "delta": {"type": "input_json_delta", "partial_json": function["arguments"]},
                        "index": index,
                    }
                    yield _event("content_block_delta", json_delta)
