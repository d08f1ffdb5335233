"""Response bodies and SSE chunks in the shapes vLLM's OpenAI server emits.

Non-streaming bodies are vLLM's ``model_dump()`` (every field present, unset ones null);
stream chunks are its ``model_dump_json(exclude_unset=True)``: no ``usage`` key except on the
final ``choices: []`` chunk when ``stream_options.include_usage`` is set.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from testbed.fakevllm.toolcalls import ParsedOutput

ZeroCachedMode = Literal["omit", "null", "zero"]


def random_id() -> str:
    """vLLM's ``random_uuid()``: 32 hex digits."""
    return uuid.uuid4().hex


def tool_call_id() -> str:
    return f"chatcmpl-tool-{random_id()}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, zero_mode: ZeroCachedMode) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens > 0 or zero_mode == "zero":
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    elif zero_mode == "null":
        body["prompt_tokens_details"] = None
    return body


def stream_usage(usage_body: dict[str, Any]) -> dict[str, Any]:
    # The final usage chunk is dumped with exclude_none: a null detail disappears.
    return {key: value for key, value in usage_body.items() if value is not None}


def chat_message(parsed: ParsedOutput, tool_call_ids: list[str]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": parsed.content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call, call_id in zip(parsed.tool_calls, tool_call_ids, strict=True)
        ],
        "reasoning_content": None,
    }


def chat_completion(
    completion_id: str,
    created: int,
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    usage_body: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_body,
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def chat_chunk(
    completion_id: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    usage_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    chunk: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage_body is not None:
        chunk["usage"] = usage_body
    return chunk


def usage_chunk(completion_id: str, created: int, model: str, usage_body: dict[str, Any], obj: str) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": stream_usage(usage_body),
    }


def text_completion(
    completion_id: str, created: int, model: str, text: str, finish_reason: str, usage_body: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_body,
        "kv_transfer_params": None,
    }


def text_completion_chunk(
    completion_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    usage_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}],
    }
    if usage_body is not None:
        chunk["usage"] = usage_body
    return chunk


def model_list(names: list[str], root: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{random_id()}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in names
        ],
    }


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
