"""Compaction on the wire: the items a client sends back, and the answers the proxy makes itself.

A client that compacts through the proxy (docs/compaction.md) gets a compaction item holding a
token (``proxy.chat.handoff``): Responses' ``{"type": "compaction", "encrypted_content": ...}``
output item, Anthropic's ``{"type": "compaction", "content": ..., "encrypted_content": ...}``
content block. Sent back, the item stands for the history it replaced; vLLM knows neither (it
refuses both), so the proxy *expands* it before anything else reads the request: into one message
carrying the summary, with the same bytes on every turn (:func:`summary_text`), so the prefix it
starts stays cached. The rest of the pipeline sees ordinary messages.

A compaction made past the client's threshold (``context_management``: Responses' ``compaction``
entry, Anthropic's ``compact_20260112`` edit) is the hosted APIs' kind: what comes before its item
is history it replaced, dropped when the item comes back (instructions aside), and the item holds
the turn it kept whole (``kept``), which it expands to after the summary. The answer that carries
it has it first (:class:`ResponsesItemFirst`, :class:`MessagesBlockFirst` for streams).

Pure: the token is opened by the ``unseal`` function the caller passes (bound to the tenant).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeGuard

from proxy.http import EventData, InvalidRequest, event_data
from proxy.openai import Continuations, Usage, dumps
from summarizer import SUMMARY_HEADER

COMPACTION = "compaction"
TRIGGER = "compaction_trigger"

# Opens a token for the request's tenant: (summary, tokens, kept items or None), or None when it
# is not one (proxy.chat.handoff.Handoff).
Unseal = Callable[[object], tuple[str, int, list[Any] | None] | None]
# Anthropic's automatic compaction edit, and its trigger's default and least value (input tokens).
COMPACT_EDIT = "compact_20260112"
ANTHROPIC_DEFAULT_TRIGGER = 150_000
ANTHROPIC_MIN_TRIGGER = 50_000
# OpenAI's least compact_threshold.
RESPONSES_MIN_THRESHOLD = 1_000


class InvalidCompactionItem(InvalidRequest):
    """400: a compaction item whose token the proxy cannot open for this tenant."""

    code = "invalid_compaction_item"


class BelowMinimum(InvalidRequest):
    """400: a threshold under the least the hosted API takes (OpenAI's code for it)."""

    code = "integer_below_min_value"


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
    and how many were; the body itself when it has none. Before the latest item made past a
    threshold only instructions (system, developer messages) are kept, and that item is followed
    by the turn it kept. Raises :class:`InvalidCompactionItem`."""
    items = body.get("input")
    if not isinstance(items, list) or _first_index(items, _is_compaction_item, "compaction item") < 0:
        return body, 0
    opened = _opened(items, unseal, lambda index: f"input[{index}]")
    start = _latest_kept(opened)
    out: list[Any] = []
    if start is not None:
        kept = opened[start][2]
        before = items[:start]
        # The client re-sends the turn the item kept right before it: its instructions are the kept ones.
        if kept and before[len(before) - len(kept) :] == kept:
            before = before[: len(before) - len(kept)]
        out = [item for item in before if is_instruction(item)]
    for index in range(start or 0, len(items)):
        handoff = opened.get(index)
        if handoff is None:
            out.append(items[index])
            continue
        out.append(summary_item(handoff[0]))
        if index == start and handoff[2] is not None:
            out.extend(handoff[2])
    return {**body, "input": out}, len(opened)


def summary_item(summary: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": summary_text(summary)}


def _opened(items: list[Any], unseal: Unseal, where: Callable[[int], str]) -> dict[int, Any]:
    """The compaction items of ``items`` by index, opened from the last back to the latest made
    past a threshold (the ones before it are dropped, and never opened); 400 for one that does
    not open."""
    opened: dict[int, Any] = {}
    for index in range(len(items) - 1, -1, -1):
        item = items[index]
        if _is(item, COMPACTION):
            handoff = unseal(item.get("encrypted_content"))
            if handoff is None:
                raise _refused(where(index))
            opened[index] = handoff
            if handoff[2] is not None:
                break
    return opened


def is_summary_message(item: Any) -> bool:
    """A user message holding nothing but a summary a compaction item expanded to."""
    content = item.get("content") if isinstance(item, dict) else None
    return item.get("role") == "user" and isinstance(content, str) and content.startswith(SUMMARY_HEADER + "\n")


def _latest_kept(opened: dict[int, Any]) -> int | None:
    """Where the latest compaction made past a threshold is (what precedes it is replaced)."""
    return max((index for index, handoff in opened.items() if handoff[2] is not None), default=None)


def is_instruction(item: Any) -> bool:
    return (
        isinstance(item, dict) and item.get("type") in (None, "message") and item.get("role") in ("system", "developer")
    )


def is_trigger_request(body: dict[str, Any]) -> bool:
    """A request asking to compact (its last input item is a ``compaction_trigger``); 400 for a
    trigger anywhere else (OpenAI: "Must be the final input item")."""
    items = body.get("input")
    if not isinstance(items, list):
        return False
    first = _first_index(items, _is_trigger, "compaction trigger")
    if 0 <= first < len(items) - 1:
        raise InvalidRequest(f"input[{first}]: a compaction_trigger must be the last input item", param="input")
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
    were; the body itself when it has none. Before the latest block made past a threshold nothing
    is kept (the system prompt is not a message), and that block becomes the user message of its
    summary, then the messages it kept. Raises :class:`InvalidCompactionItem`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or _first_compaction(messages) < 0:
        return body, 0
    opened: dict[int, dict[int, Any]] = {}
    # From the last back to the latest block made past a threshold: what precedes it is dropped unopened.
    for index in range(len(messages) - 1, -1, -1):
        if _holds_compaction(messages[index]):
            opened[index] = _opened(messages[index]["content"], unseal, partial(_block_place, index))
            if any(handoff[2] is not None for handoff in opened[index].values()):
                break
    kept_at = [(index, number) for index, blocks in opened.items() for number, h in blocks.items() if h[2] is not None]
    start = max(kept_at, default=None)
    out: list[Any] = []
    for index in range(start[0] if start else 0, len(messages)):
        message = messages[index]
        handoffs = opened.get(index)
        if handoffs is None:
            out.append(message)
            continue
        if start is not None and index == start[0]:
            handoff = handoffs[start[1]]
            out.append({"role": "user", "content": summary_text(handoff[0])})
            out.extend(handoff[2])
            rest = message["content"][start[1] + 1 :]
            after = {number - start[1] - 1: h for number, h in handoffs.items() if number > start[1]}
            if rest:
                out.append(_blocks_expanded({**message, "content": rest}, after))
            continue
        out.append(_blocks_expanded(message, handoffs))
    return {**body, "messages": out}, sum(len(blocks) for blocks in opened.values())


def _block_place(index: int, number: int) -> str:
    return f"messages[{index}].content[{number}]"


def _blocks_expanded(message: dict[str, Any], handoffs: dict[int, Any]) -> dict[str, Any]:
    """``message`` with its compaction blocks as the text of their summaries; an assistant message
    holding nothing but one becomes the user message of that text."""
    content = message["content"]
    blocks = [
        {"type": "text", "text": summary_text(handoffs[n][0])} if n in handoffs else b for n, b in enumerate(content)
    ]
    if len(blocks) == 1 and handoffs and message.get("role") == "assistant":
        return {"role": "user", "content": blocks[0]["text"]}
    return {**message, "content": blocks}


# The last lists scanned, per test, with where the first match was (-1: none): a conversation's next
# request scans only the messages (items) that are not the very objects scanned then.
_SCANNED: Continuations[int] = Continuations()


def _first_index(items: list[Any], test: Callable[[Any], bool], part: str) -> int:
    """The index of the first of ``items`` that ``test`` holds for (-1: none)."""
    resumed = _SCANNED.resume("", items, part)
    start = resumed.identical()
    first = resumed.state
    if first is not None and 0 <= first < start:
        start = first  # found there then: the same object now
    found = next((index for index in range(start, len(items)) if test(items[index])), -1)
    resumed.keep(items, found)
    return found


def _first_compaction(messages: list[Any]) -> int:
    """The index of the first message holding a compaction block (-1: none)."""
    return _first_index(messages, _holds_compaction, "compaction block")


def _is_compaction_item(item: Any) -> bool:
    return _is(item, COMPACTION)


def _is_trigger(item: Any) -> bool:
    return _is(item, TRIGGER)


def _holds_compaction(message: Any) -> bool:
    # Asked of every message of every Messages request: a plain loop, no call per block.
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return False
    for block in content:  # noqa: SIM110 (any() of a generator: a frame per message)
        if isinstance(block, dict) and block.get("type") == COMPACTION:
            return True
    return False


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


# -- compaction past a threshold (context_management) ------------------------------------------


@dataclass(frozen=True)
class AutoCompaction:
    """A request's ask to be compacted once its input reaches ``threshold`` tokens (None: once it
    would not fit the model's context), with its own summarization prompt, and on Anthropic whether
    to answer with the compaction alone (``pause_after_compaction``)."""

    threshold: int | None
    instruction: str | None = None
    pause: bool = False


def responses_auto_compaction(body: dict[str, Any]) -> tuple[dict[str, Any], AutoCompaction | None]:
    """The request's ``context_management`` ``compaction`` entry, checked as OpenAI checks it, and
    the body without it (entries of other types stay, as sent)."""
    entries = body.get("context_management")
    if entries is None:
        return body, None
    if not isinstance(entries, list):
        raise InvalidRequest("'context_management' must be an array of entries", param="context_management")
    found, rest = _one_of(
        entries,
        COMPACTION,
        lambda index: f"context_management[{index}]",
        "'context_management' may hold one compaction entry",
    )
    if found is None:
        return body, None
    where, entry = found
    threshold = entry.get("compact_threshold")
    if threshold is not None:
        if not _is_int(threshold):
            raise InvalidRequest(f"'{where}.compact_threshold' must be an integer", param=f"{where}.compact_threshold")
        if threshold < RESPONSES_MIN_THRESHOLD:
            raise BelowMinimum(
                f"Invalid '{where}.compact_threshold': integer below minimum value. Expected a value >= "
                f"{RESPONSES_MIN_THRESHOLD}, but got {threshold} instead.",
                param=f"{where}.compact_threshold",
            )
    without = {key: value for key, value in body.items() if key != "context_management"}
    return ({**without, "context_management": rest} if rest else without), AutoCompaction(threshold)


def messages_auto_compaction(body: dict[str, Any]) -> tuple[dict[str, Any], AutoCompaction | None]:
    """The request's ``context_management`` ``compact_20260112`` edit, checked as Anthropic checks
    it, and the body without it (other edits stay, as sent)."""
    config = body.get("context_management")
    edits = config.get("edits") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(edits, list):
        return body, None
    found, rest = _one_of(
        edits,
        COMPACT_EDIT,
        lambda index: f"context_management.edits.{index}",
        f"only one {COMPACT_EDIT} edit is allowed",
    )
    if found is None:
        return body, None
    where, edit = found
    trigger, threshold = edit.get("trigger"), ANTHROPIC_DEFAULT_TRIGGER
    if trigger is not None:
        value = trigger.get("value") if isinstance(trigger, dict) and trigger.get("type") == "input_tokens" else None
        if not _is_int(value):
            raise InvalidRequest(
                f'{where}.trigger: must be {{"type": "input_tokens", "value": <integer>}}', param=f"{where}.trigger"
            )
        if value < ANTHROPIC_MIN_TRIGGER:
            raise InvalidRequest(
                f"{where}.trigger.value: must be at least {ANTHROPIC_MIN_TRIGGER}", param=f"{where}.trigger.value"
            )
        threshold = value
    instructions = edit.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest(f"{where}.instructions: must be a string", param=f"{where}.instructions")
    pause = edit.get("pause_after_compaction", False)
    if not isinstance(pause, bool):
        raise InvalidRequest(
            f"{where}.pause_after_compaction: must be a boolean", param=f"{where}.pause_after_compaction"
        )
    rest_config = {key: value for key, value in config.items() if key != "edits"}
    if rest:
        rest_config["edits"] = rest
    without = {key: value for key, value in body.items() if key != "context_management"}
    compaction = AutoCompaction(threshold, compaction_instruction(edit), pause)
    return ({**without, "context_management": rest_config} if rest_config else without), compaction


def _one_of(
    entries: list[Any], kind: str, where: Callable[[int], str], only_one: str
) -> tuple[tuple[str, dict[str, Any]] | None, list[Any]]:
    """The one entry of ``kind`` among ``entries`` (with the name of its place), and the others as
    sent; 400 for a second one."""
    found: tuple[str, dict[str, Any]] | None = None
    rest: list[Any] = []
    for index, entry in enumerate(entries):
        if not _is(entry, kind):
            rest.append(entry)
        elif found is not None:
            raise InvalidRequest(f"{where(index)}: {only_one}", param=where(index))
        else:
            found = (where(index), entry)
    return found, rest


def responses_turn_start(items: list[Any]) -> int:
    """Where the client's last turn starts (its last user message): what comes before it is the
    history a compaction replaces; 0 when there is none to replace."""
    for index in range(len(items) - 1, -1, -1):
        item = items[index]
        if isinstance(item, dict) and item.get("type") in (None, "message") and item.get("role") == "user":
            return index if any(not is_instruction(earlier) for earlier in items[:index]) else 0
    return 0


def messages_turn_start(messages: list[Any]) -> int:
    """Where the client's last turn starts: its last user message that is not only tool results
    (those answer the assistant's calls before them, which stay with them)."""
    for index in range(len(messages) - 1, 0, -1):
        message = messages[index]
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        content = message.get("content")
        if not isinstance(content, list) or any(not _is(block, "tool_result") for block in content):
            return index
    return 0


def compaction_block(summary: str, token: str) -> dict[str, Any]:
    return {"type": COMPACTION, "content": summary, "encrypted_content": token}


def responses_with_item(answer: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
    """The backend's Response with the compaction item first in its output, as OpenAI places it."""
    output = answer.get("output")
    return {**answer, "output": [item, *(output if isinstance(output, list) else [])]}


def messages_with_block(answer: dict[str, Any], block: dict[str, Any], usage: Usage | None) -> dict[str, Any]:
    """The backend's Message with the compaction block first in its content, and its usage split in
    ``iterations`` (the compaction's, then the message's), as Anthropic reports it."""
    content = answer.get("content")
    patched = {**answer, "content": [block, *(content if isinstance(content, list) else [])]}
    answered = answer.get("usage")
    if isinstance(answered, dict):
        patched["usage"] = {**answered, "iterations": _iterations(usage, answered)}
    return patched


def _iterations(compaction: Usage | None, message: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic's ``usage.iterations``: the compaction's usage, then the message's."""
    counts = {key: message[key] for key in _ANTHROPIC_COUNTS if key in message}
    return [{"type": COMPACTION, **anthropic_usage(compaction)}, {"type": "message", **counts}]


_ANTHROPIC_COUNTS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens")
_RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


class ResponsesItemFirst:
    """A Responses event stream with the compaction item as its first output item: its
    ``output_item.added`` and ``done`` once the response is created, every later event's
    ``output_index`` and ``sequence_number`` moved past them, and the item first in the final
    response's output. Fed the relay's blocks of whole events, in order."""

    def __init__(self, item: dict[str, Any]) -> None:
        self._item = item
        self._created = False
        self._sequence_shift: int | None = None

    def __call__(self, block: bytes) -> bytes:
        return _each_event(block, self._event)

    def _event(self, event: bytes, data: EventData) -> bytes | None:
        payload = data.payload
        kind = payload.get("type")
        if self._sequence_shift is None:
            if kind == "response.created":
                self._created = True
            # First after the response is created, as OpenAI sends it; never before an error.
            if not self._created or kind in ("response.created", "response.in_progress", "error", "response.failed"):
                return None
            number = payload.get("sequence_number")
            first = number if _is_int(number) else None
            self._sequence_shift = 2 if first is not None else 0
            injected = b"".join(
                _sse(
                    name,
                    {
                        "type": name,
                        **({"sequence_number": first + n} if first is not None else {}),
                        "output_index": 0,
                        "item": self._item,
                    },
                )
                for n, name in enumerate(("response.output_item.added", "response.output_item.done"))
            )
            return injected + self._shifted(event, data)
        return self._shifted(event, data)

    def _shifted(self, event: bytes, data: EventData) -> bytes:
        patched = dict(data.payload)
        if _is_int(patched.get("output_index")):
            patched["output_index"] += 1
        if self._sequence_shift and _is_int(patched.get("sequence_number")):
            patched["sequence_number"] += self._sequence_shift
        response = patched.get("response")
        if patched.get("type") in _RESPONSE_ENDS and isinstance(response, dict):
            patched["response"] = responses_with_item(response, self._item)
        return data.replaced(event, patched) + b"\n\n"


class MessagesBlockFirst:
    """An Anthropic event stream with the compaction block as its first content block: its start,
    one ``compaction_delta`` and its stop right after ``message_start``, every later block's
    ``index`` moved past it, and ``usage.iterations`` in ``message_delta`` (the compaction's, then
    the message's: its counts from ``message_start``, updated by the delta's). Fed the relay's
    blocks of whole events, in order."""

    def __init__(self, block: dict[str, Any], usage: Usage | None = None) -> None:
        self._block = block
        self._usage = usage
        self._injected = False
        self._started: dict[str, Any] = {}

    def __call__(self, block: bytes) -> bytes:
        return _each_event(block, self._event)

    def _event(self, event: bytes, data: EventData) -> bytes | None:
        payload = data.payload
        if not self._injected:
            if payload.get("type") != "message_start":
                return None
            self._injected = True
            message = payload.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            self._started = usage if isinstance(usage, dict) else {}
            return event + b"\n\n" + _block_events(0, self._block)
        kind = str(payload.get("type", ""))
        if kind.startswith("content_block_") and _is_int(payload.get("index")):
            return data.replaced(event, {**payload, "index": payload["index"] + 1}) + b"\n\n"
        usage = payload.get("usage")
        if kind == "message_delta" and isinstance(usage, dict):
            counts = {**self._started, **{key: value for key, value in usage.items() if value is not None}}
            iterations = _iterations(self._usage, counts)
            return data.replaced(event, {**payload, "usage": {**usage, "iterations": iterations}}) + b"\n\n"
        return None


def _block_events(index: int, block: dict[str, Any]) -> bytes:
    start = {"type": COMPACTION, "content": None, "encrypted_content": None}
    delta = {"type": "compaction_delta", "content": block["content"], "encrypted_content": block["encrypted_content"]}
    events: list[tuple[str, dict[str, Any]]] = [
        ("content_block_start", {"index": index, "content_block": start}),
        ("content_block_delta", {"index": index, "delta": delta}),
        ("content_block_stop", {"index": index}),
    ]
    return b"".join(_sse(name, {"type": name, **fields}) for name, fields in events)


def _each_event(block: bytes, rewrite: Callable[[bytes, EventData], bytes | None]) -> bytes:
    """``block`` (whole SSE events) with each event whose data is a JSON object passed to
    ``rewrite``, which answers its replacement (the event's end included), or None to keep it."""
    out: list[bytes] = []
    for event in block.split(b"\n\n"):
        if not event:
            continue
        data = event_data(event)
        replaced = rewrite(event, data) if data is not None else None
        out.append(replaced if replaced is not None else event + b"\n\n")
    return b"".join(out)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


# -- helpers -----------------------------------------------------------------------------------


def _is(item: Any, kind: str) -> bool:
    return isinstance(item, dict) and item.get("type") == kind


def _sse(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(payload) + b"\n\n"
