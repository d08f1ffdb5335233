"""``/v1/responses`` as vLLM 0.32 serves it (non-Harmony models): rendered as a chat completion.

Mirrors ``vllm/entrypoints/openai/responses``: ``instructions`` is the system message; a chained
request (``previous_response_id``) starts with the stored input messages of the previous request
(system message left out) and the previous output's *messages* (its function calls are not
re-rendered), then the new input; a ``function_call`` item joins the assistant message before it,
``function_call_output`` is a ``tool`` message. Responses are stored in the process, as vLLM does
with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``store`` is ignored without it). Usage reports the
whole prompt in ``input_tokens`` and the cached part in ``input_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from testbed.fakevllm.via_chat import cache_write_tokens, copy_fields, stream_chunks

MAX_STORED = 10_000


@dataclass
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    """vLLM's in-process ``response_store`` and ``msg_store`` (bounded here)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._items[response["id"]] = Stored(response, messages)
        while len(self._items) > MAX_STORED:
            self._items.popitem(last=False)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def not_found(response_id: str) -> dict[str, Any]:
    return {
        "error": {
            "message": f"Response with id '{response_id}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }


# -- request ---------------------------------------------------------------------------------


def input_messages(body: dict[str, Any], previous: Stored | None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    if previous is not None:
        messages.extend(m for m in previous.messages if m.get("role") != "system")
        for item in previous.response.get("output") or []:
            if item.get("type") == "message":
                for part in item.get("content") or []:
                    messages.append({"role": "assistant", "content": part.get("text")})
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages
    converted: list[dict[str, Any]] = []
    for item in value or []:
        _add_item(item, converted)
    messages.extend(converted)
    return messages


def _add_item(item: dict[str, Any], out: list[dict[str, Any]]) -> None:
    previous = out[-1] if out and out[-1].get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        if previous is not None:
            previous.setdefault("tool_calls", []).append(call)
            return
        out.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output":
        out.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
    elif kind == "reasoning":
        return
    elif item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else (content[0].get("text") if content else None)
        if previous is not None and previous.get("content") is None:
            previous["content"] = text
            return
        out.append({"role": "assistant", "content": text})
    elif "role" in item:
        content = item.get("content")
        if isinstance(content, list):
            # vLLM's chat parser reads input_text parts as text
            content = [
                {"type": "text", "text": p.get("text", "")} if p.get("type") in ("input_text", "output_text") else p
                for p in content
            ]
        out.append({"role": item["role"], "content": content})
    else:
        raise ValueError(f"Unsupported input item type: {kind}")


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """vLLM's ``construct_tool_dicts``: a chat tool per function tool, its function dumped as
    ``FunctionDefinition`` dumps it (name, description, parameters; strict and defer_loading only
    when set)."""
    tools = []
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue
        function = {
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
        }
        for key in ("strict", "defer_loading"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        tools.append({"type": "function", "function": function})
    return tools or None


def chat_request(body: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = chat_tools(body)
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice", "auto")
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": choice}
    copy_fields(body, chat, ("max_output_tokens", "max_tokens"), {"include_usage": True})
    return chat


# -- answer ----------------------------------------------------------------------------------


def usage(chat_usage: dict[str, Any] | None, block_size: int) -> dict[str, Any]:
    prompt = int((chat_usage or {}).get("prompt_tokens") or 0)
    output = int((chat_usage or {}).get("completion_tokens") or 0)
    cached = int(((chat_usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": cache_write_tokens(prompt, cached, block_size),
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + output,
    }


def response_object(
    body: dict[str, Any],
    response_id: str,
    model: str,
    output: list[dict[str, Any]],
    status: str,
    usage_body: dict[str, Any] | None,
    created_at: int,
) -> dict[str, Any]:
    choice = body.get("tool_choice", "auto") if body.get("tools") else "none"
    return {
        "id": response_id,
        "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": True,
        "temperature": body.get("temperature", 1.0),
        "tool_choice": choice,
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "background": False,
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": None,
        "previous_response_id": body.get("previous_response_id"),
        "prompt": None,
        "reasoning": None,
        "service_tier": "auto",
        "status": status,
        "text": None,
        "top_logprobs": None,
        "truncation": "disabled",
        "usage": usage_body,
        "user": body.get("user"),
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if status == "completed":
        content.append({"annotations": [], "text": text, "type": "output_text", "logprobs": None})
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message"}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
        "type": "function_call",
        "id": item_id,
        "status": status,
    }


def output_items(chat: dict[str, Any]) -> list[dict[str, Any]]:
    message = chat["choices"][0]["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        output.append(call_item(new_id("fc"), call["id"], function["name"], function["arguments"]))
    return output


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def full(body: dict[str, Any], response_id: str, chat: dict[str, Any], block_size: int) -> dict[str, Any]:
    reason = chat["choices"][0].get("finish_reason")
    return response_object(
        body,
        response_id,
        chat["model"],
        output_items(chat),
        status_of(reason),
        usage(chat.get("usage"), block_size),
        int(time.time()),
    )


def _event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def stream(
    body: dict[str, Any],
    response_id: str,
    model: str,
    chunks: AsyncIterable[Any],
    block_size: int,
    on_done: Any,
) -> AsyncIterator[str]:
    """Responses' typed events over a chat completion stream; ``on_done(response)`` at the end."""
    sequence = 0
    created_at = int(time.time())
    output: list[dict[str, Any]] = []
    text_item: dict[str, Any] | None = None
    text_parts: list[str] = []
    call: dict[str, Any] | None = None
    finish_reason: str | None = None
    final_usage: dict[str, Any] | None = None
    started = False

    def event(payload: dict[str, Any]) -> str:
        nonlocal sequence
        payload["sequence_number"] = sequence
        sequence += 1
        return _event(payload)

    def close_text() -> list[str]:
        nonlocal text_item
        if text_item is None:
            return []
        text = "".join(text_parts)
        index = len(output)
        done = message_item(text_item["id"], text)
        part = done["content"][0]
        events = [
            event(
                {
                    "content_index": 0,
                    "item_id": text_item["id"],
                    "logprobs": [],
                    "output_index": index,
                    "text": text,
                    "type": "response.output_text.done",
                }
            ),
            event(
                {
                    "content_index": 0,
                    "item_id": text_item["id"],
                    "output_index": index,
                    "part": part,
                    "type": "response.content_part.done",
                }
            ),
            event({"item": done, "output_index": index, "type": "response.output_item.done"}),
        ]
        output.append(done)
        text_item = None
        text_parts.clear()
        return events

    def close_call() -> list[str]:
        nonlocal call
        if call is None:
            return []
        index = len(output)
        done = call_item(call["id"], call["call_id"], call["name"], call["arguments"])
        events = [
            event(
                {
                    "arguments": call["arguments"],
                    "item_id": call["id"],
                    "name": call["name"],
                    "output_index": index,
                    "type": "response.function_call_arguments.done",
                }
            ),
            event({"item": done, "output_index": index, "type": "response.output_item.done"}),
        ]
        output.append(done)
        call = None
        return events

    async for raw in chunks:
        for chunk in stream_chunks(raw):
            if chunk is None:  # [DONE]
                continue
            if not started:
                started = True
                opening = response_object(body, response_id, model, [], "in_progress", None, created_at)
                yield event({"response": opening, "type": "response.created"})
                yield event({"response": opening, "type": "response.in_progress"})
            if not chunk.get("choices"):
                final_usage = chunk.get("usage")
                continue
            choice = chunk["choices"][0]
            if choice.get("finish_reason") is not None:
                finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                for out in close_call():
                    yield out
                if text_item is None:
                    text_item = message_item(new_id("msg"), "", status="in_progress")
                    yield event({"item": text_item, "output_index": len(output), "type": "response.output_item.added"})
                    empty = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
                    yield event(
                        {
                            "content_index": 0,
                            "item_id": text_item["id"],
                            "output_index": len(output),
                            "part": empty,
                            "type": "response.content_part.added",
                        }
                    )
                text_parts.append(content)
                yield event(
                    {
                        "content_index": 0,
                        "delta": content,
                        "item_id": text_item["id"],
                        "logprobs": [],
                        "output_index": len(output),
                        "type": "response.output_text.delta",
                    }
                )
            for tool in delta.get("tool_calls") or []:
                function = tool.get("function") or {}
                if tool.get("id") is not None and function.get("name") is not None:
                    for out in [*close_text(), *close_call()]:
                        yield out
                    call = call_item(new_id("fc"), tool["id"], function["name"], "", status="in_progress")
                    yield event({"item": dict(call), "output_index": len(output), "type": "response.output_item.added"})
                if call is not None and function.get("arguments"):
                    call["arguments"] += function["arguments"]
                    yield event(
                        {
                            "delta": function["arguments"],
                            "item_id": call["id"],
                            "output_index": len(output),
                            "type": "response.function_call_arguments.delta",
                        }
                    )
    for out in [*close_text(), *close_call()]:
        yield out
    status = status_of(finish_reason)
    done = response_object(body, response_id, model, output, status, usage(final_usage, block_size), created_at)
    on_done(done)
    # vLLM ends an incomplete response (max_output_tokens) with response.completed too.
    yield event({"response": done, "type": "response.completed"})
