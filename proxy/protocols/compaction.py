"""Compaction on the wire: the items a client sends back, and the answers the proxy makes itself.

A client that compacts through the proxy (docs/compaction.md) gets a compaction item holding a
token (``proxy.chat.handoff``): Responses' ``{"type": "compaction", "encrypted_content": ...}``
output item, Anthropic's ``{"type": "compaction", "content": ..., "encrypted_content": ...}``
content block. Sent back, the item stands for the history it replaced; vLLM knows neither (it
refuses both), so the proxy *expands* it before anything else reads the request: into one message
carrying the summary, with the same bytes on every turn (:func:`summary_text`), so the prefix it
starts stays cached. The rest of the pipeline sees ordinary messages.

Pure: the token is opened by the ``unseal`` function the caller passes (bound to the tenant).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from proxy.http import InvalidRequest
from proxy.openai import Usage
from summarizer import SUMMARY_HEADER

COMPACTION = "compaction"
TRIGGER = "compaction_trigger"

# Opens a token for the request's tenant: (summary, tokens), or None when it is not one.
Unseal = Callable[[object], tuple[str, int] | None]


class InvalidCompactionItem(InvalidRequest):
    """400: a compaction item whose token the proxy cannot open for this tenant."""

    code = "invalid_compaction_item"


def summary_text(summary: str) -> str:
    """The text a compaction item expands to: the summarizer's framing, the same bytes every turn."""
    return f"{SUMMARY_HEADER}\n{summary}"


def _refused(where: str) -> InvalidCompactionItem:
    return InvalidCompactionItem(
        f"{where} is a compaction item this proxy did not issue for this API key, or one that was altered "
        "(its encrypted_content does not verify; a proxy whose key changed no longer opens its earlier items). "
        "Send the conversation without it: the messages it replaced, or none, then compact again.",
        param=f"{where}.encrypted_content",
    )


def compaction_id(token: str) -> str:
    """The item's id: derived from its token, so the same compaction has the same id."""
    return "cmp_" + hashlib.sha256(token.encode("ascii")).hexdigest()[:32]


# -- Responses ---------------------------------------------------------------------------------


def expand_responses(body: dict[str, Any], unseal: Unseal) -> tuple[dict[str, Any], int]:
    """``body`` with every ``compaction`` input item replaced by the user message of its summary,
    and how many were; the body itself when it has none. Raises :class:`InvalidCompactionItem`."""
    items = body.get("input")
    if not isinstance(items, list) or not any(_is(item, COMPACTION) for item in items):
        return body, 0
    out: list[Any] = []
    for index, item in enumerate(items):
        if not _is(item, COMPACTION):
            out.append(item)
            continue
        opened = unseal(item.get("encrypted_content"))
        if opened is None:
            raise _refused(f"input[{index}]")
        out.append({"type": "message", "role": "user", "content": summary_text(opened[0])})
    return {**body, "input": out}, sum(1 for item in items if _is(item, COMPACTION))


def is_trigger_request(body: dict[str, Any]) -> bool:
    """A request asking to compact (its last input item is a ``compaction_trigger``); 400 for a
    trigger anywhere else (OpenAI: "Must be the final input item")."""
    items = body.get("input")
    if not isinstance(items, list):
        return False
    for index, item in enumerate(items[:-1]):
        if _is(item, TRIGGER):
            raise InvalidRequest(f"input[{index}]: a compaction_trigger must be the last input item", param="input")
    return bool(items) and _is(items[-1], TRIGGER)


def without_trigger(body: dict[str, Any]) -> dict[str, Any]:
    items = body["input"]
    return {**body, "input": items[:-1] if items and _is(items[-1], TRIGGER) else items}


def retained_user_items(items: Any) -> list[Any]:
    """What ``/v1/responses/compact`` keeps of the input: its user messages, as the client sent them."""
    if isinstance(items, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    if not isinstance(items, list):
        return []
    # As the client sent them (the same bytes on its next request), typed as the output items they are.
    return [
        item if "type" in item else {"type": "message", **item}
        for item in items
        if isinstance(item, dict) and item.get("type") in (None, "message") and item.get("role") == "user"
    ]


def compaction_item(token: str) -> dict[str, Any]:
    return {"type": COMPACTION, "id": compaction_id(token), "encrypted_content": token}


def responses_usage(usage: Usage | None) -> dict[str, Any]:
    prompt, cached, completion = (
        (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) if usage else (0, 0, 0)
    )
    return {
        "input_tokens": prompt,
        # No explicit cache writes (OpenAI's prompt_cache_options mode "explicit"): vLLM caches implicitly.
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def responses_answer(
    body: dict[str, Any], response_id: str, created_at: int, output: list[Any], usage: Usage | None
) -> dict[str, Any]:
    """The Response object of a ``compaction_trigger`` request: its one compaction output item."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "completed",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": body["model"],
        "output": output,
        "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "previous_response_id": None,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": body.get("reasoning"),
        "store": False,
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation", "disabled"),
        "usage": responses_usage(usage),
        "user": body.get("user"),
    }


def responses_events(answer: dict[str, Any]) -> bytes:
    """The answer as a Responses event stream: created, each output item added and done, completed."""
    started = {**answer, "status": "in_progress", "output": [], "usage": None}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
    ]
    for index, item in enumerate(answer["output"]):
        events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.completed", "response": answer})
    return b"".join(_sse(event["type"], {**event, "sequence_number": n}) for n, event in enumerate(events))


def compacted_response(response_id: str, created_at: int, output: list[Any], usage: Usage | None) -> dict[str, Any]:
    """``/v1/responses/compact``'s answer (OpenAI's ``CompactedResponse``)."""
    return {
        "id": response_id,
        "object": "response.compaction",
        "created_at": created_at,
        "output": output,
        "usage": responses_usage(usage),
    }


# -- Anthropic Messages ------------------------------------------------------------------------


def expand_messages(body: dict[str, Any], unseal: Unseal) -> tuple[dict[str, Any], int]:
    """``body`` with every ``compaction`` content block replaced by the text of its summary (an
    assistant message holding nothing else becomes the user message of that text), and how many
    were; the body itself when it has none. Raises :class:`InvalidCompactionItem`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not any(_holds_compaction(m) for m in messages):
        return body, 0
    out: list[Any] = []
    expanded = 0
    for index, message in enumerate(messages):
        if not _holds_compaction(message):
            out.append(message)
            continue
        blocks: list[Any] = []
        only = True
        for number, block in enumerate(message["content"]):
            if not _is(block, COMPACTION):
                blocks.append(block)
                only = False
                continue
            opened = unseal(block.get("encrypted_content"))
            if opened is None:
                raise _refused(f"messages[{index}].content[{number}]")
            blocks.append({"type": "text", "text": summary_text(opened[0])})
            expanded += 1
        if only and len(blocks) == 1 and message.get("role") == "assistant":
            out.append({"role": "user", "content": blocks[0]["text"]})
        else:
            out.append({**message, "content": blocks})
    return {**body, "messages": out}, expanded


def _holds_compaction(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(_is(block, COMPACTION) for block in content)


def compaction_param(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's ``compaction`` parameter (on-demand compaction), checked; None without one."""
    value = body.get("compaction")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "summarize":
        raise InvalidRequest(
            '\'compaction\' must be {"type": "summarize"} (with optional instructions)', param="compaction"
        )
    instructions = value.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'compaction.instructions' must be a string", param="compaction.instructions")
    if body.get("context_management") is not None:
        raise InvalidRequest("'compaction' cannot be combined with 'context_management'", param="compaction")
    return value


def compaction_instruction(param: dict[str, Any]) -> str | None:
    """The request's own summarization prompt; empty or only whitespace counts as absent."""
    instructions = param.get("instructions")
    return instructions if isinstance(instructions, str) and instructions.strip() else None


def anthropic_usage(usage: Usage | None) -> dict[str, Any]:
    prompt, cached, completion = (
        (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) if usage else (0, 0, 0)
    )
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": completion,
    }


def anthropic_answer(message_id: str, model: str, summary: str, token: str, usage: Usage | None) -> dict[str, Any]:
    """The Message of an on-demand compaction: one ``compaction`` block, ``stop_reason`` ``compaction``."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": COMPACTION, "content": summary, "encrypted_content": token}],
        "stop_reason": "compaction",
        "stop_sequence": None,
        "usage": anthropic_usage(usage),
    }


def anthropic_events(answer: dict[str, Any]) -> bytes:
    """The Message as Anthropic's event stream: message_start, the block (start, one
    ``compaction_delta`` with its content and token, stop), message_delta, message_stop."""
    usage = answer["usage"]
    start_usage = {**usage, "output_tokens": 0}
    message = {**answer, "content": [], "stop_reason": None, "usage": start_usage}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": message}]
    for index, block in enumerate(answer["content"]):
        events.append(
            {
                "type": "content_block_start",
                "index": index,
                "content_block": {"type": COMPACTION, "content": None, "encrypted_content": None},
            }
        )
        delta = {
            "type": "compaction_delta",
            "content": block["content"],
            "encrypted_content": block["encrypted_content"],
        }
        events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": answer["stop_reason"], "stop_sequence": None},
            "usage": usage,
        }
    )
    events.append({"type": "message_stop"})
    return b"".join(_sse(event["type"], event) for event in events)


# -- helpers -----------------------------------------------------------------------------------


def _is(item: Any, kind: str) -> bool:
    return isinstance(item, dict) and item.get("type") == kind


def _sse(name: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n".encode()
