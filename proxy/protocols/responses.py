"""OpenAI Responses (``POST /v1/responses``) through the chat pipeline.

vLLM renders a Responses request as a chat conversation (``construct_input_messages`` in
``vllm/entrypoints/openai/responses/utils.py``): ``instructions`` as the system message, a
string ``input`` as one user message, input items in order, a ``function_call`` joining the
assistant message before it, a ``function_call_output`` as a ``tool`` message, message items
with a role passed as they are. With ``previous_response_id`` it prepends the stored
conversation (its input messages, without their system message, and the output *messages* of
the previous response: not its function calls) to the new input.

:class:`ResponsesView` builds that conversation from the request (the stored part of a chain
is not in the request: the view holds the new turn only) and maps the canonical view back onto
the client's items: an unchanged view message is the client's own items, byte for byte; a
rewritten one gets only the rewritten fields (a call id, arguments, text); inserted system
messages become ``{"role": "system", "content": ...}`` items, which vLLM renders in place.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.canon import ToolOrders, canonicalize_tool_fields
from proxy.http import (
    RESPONSES_API,
    InvalidRequest,
    SSERelay,
    final_event,
    is_text,
    reading,
    require_model,
    with_data_fields,
)
from proxy.openai import (
    STABLE_ROLES,
    AssistantRecorder,
    Continuations,
    ToolCall,
    Usage,
    sort_keys_deep,
    token_count,
)
from proxy.protocols.align import Aligned, align, same_message, unchanged_lead
from proxy.protocols.base import GenerationProtocol, event_payloads, summary_options, texts, tool_views

# Ties a system/developer text part of the view to the client's content part (stripped on the way back).
PART_KEY = "_part"
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


# -- validation ------------------------------------------------------------------------------


# The roles of a Responses message item (vLLM's, OpenAI's), and the content parts that carry text.
ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})


def validate_request(body: dict[str, Any], namespace: str = "") -> None:
    """Types of everything the proxy reads (400 naming the parameter); the rest is vLLM's to judge
    (``namespace``: the tenant, whose conversation's items validated before are not again)."""
    reading.RESPONSES.read(body)
    require_model(body)
    value = body.get("input")
    if not isinstance(value, str | list):
        raise InvalidRequest("'input' must be a string or an array of items", param="input")
    if isinstance(value, list):
        # Items that are the very objects validated in the last request of the conversation (a long
        # body's history, from the resumed parse) passed then; the rest are checked.
        resumed = _INPUTS.resume(namespace, value, "validated")
        for index in range(resumed.identical(), len(value)):
            _validate_item(value[index], f"input[{index}]")
        resumed.keep(value, True)
    for key, kind, what in (
        ("instructions", str, "a string"),
        ("previous_response_id", str, "a string"),
        ("prompt_cache_key", str, "a string"),
        ("tools", list, "an array"),
        ("tool_choice", str | dict, "a string or an object"),
        ("stream", bool, "a boolean"),
        ("store", bool, "a boolean"),
    ):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise InvalidRequest(f"'{key}' must be {what}", param=key)
    for index, tool in enumerate(body.get("tools") or ()):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{index}] must be an object", param=f"tools[{index}]")
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and not (is_text(previous) and 0 < len(previous) <= 256):
        raise InvalidRequest("'previous_response_id' is not a response id", param="previous_response_id")
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
        raise InvalidRequest("'max_output_tokens' must be an integer", param="max_output_tokens")


def _validate_item(item: Any, param: str) -> None:
    if not isinstance(item, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    role = item.get("role")
    # Only a message item has a role vLLM checks (other items' extra keys are ignored there).
    is_message = item.get("type") in (None, "message")
    if role is not None and (not isinstance(role, str) or (is_message and role not in ROLES)):
        shown = role if is_text(role) else type(role).__name__
        raise InvalidRequest(f"{param}.role {shown!r} is not a valid role"[:300], param=f"{param}.role")
    content = item.get("content")
    if content is not None and not isinstance(content, str | list):
        raise InvalidRequest(f"{param}.content must be a string or an array", param=f"{param}.content")
    for index, part in enumerate(content if isinstance(content, list) else ()):
        if not isinstance(part, dict):
            raise InvalidRequest(f"{param}.content must hold objects", param=f"{param}.content")
        # A part's kind is a string (vLLM's parts are a union told apart by it); the text the proxy
        # reads (and vLLM requires) of a text part: a string, as vLLM judges it.
        kind = part.get("type")
        if kind is not None and not isinstance(kind, str):
            where = f"{param}.content[{index}].type"
            raise InvalidRequest(f"{where} must be a string", param=where)
        if kind in TEXT_PARTS and not isinstance(part.get("text"), str):
            where = f"{param}.content[{index}].text"
            raise InvalidRequest(f"{where} must be a string", param=where)
    for key in ("call_id", "name", "arguments", "type"):
        if item.get(key) is not None and not isinstance(item[key], str):
            raise InvalidRequest(f"{param}.{key} must be a string", param=f"{param}.{key}")


# -- the view --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Source:
    """The input items a view message was made from; ``instructions``: the system message is the
    request's ``instructions``; ``text``: the request's ``input`` is a string."""

    items: tuple[int, ...] = ()
    instructions: bool = False
    text: bool = False


@dataclass
class ResponsesView:
    body: dict[str, Any]
    chat: dict[str, Any]
    sources: list[Source]
    actions: list[str] = field(default_factory=list)
    # The input's view messages start at ``items_at``; the first ``m`` of them are made of items
    # ``0`` to ``covered[m]``, in order, each once, none left unviewed between (None: not known).
    items_at: int = 0
    covered: list[int] | None = None

    @classmethod
    def of(cls, body: dict[str, Any], tool_orders: ToolOrders | None = None, namespace: str = "") -> ResponsesView:
        """The view of a validated request, its tools canonicalized first (on a copy), as the chat
        engine does (``tool_orders``: only an app's seen to vary; ``namespace``: the tenant).

        A chained request's ``instructions`` stay out of the view, as they are: vLLM renders them
        above the stored history and drops system messages from what it stores, so lines moved
        out of them would not stay where they were put, and the next turn would miss from there.
        """
        body = dict(body)
        actions = [str(action) for action in canonicalize_tool_fields(body, tool_orders, namespace)]
        messages: list[dict[str, Any]] = []
        sources: list[Source] = []
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions and body.get("previous_response_id") is None:
            messages.append({"role": "system", "content": instructions})
            sources.append(Source(instructions=True))
        value = body["input"]
        if isinstance(value, str):
            messages.append({"role": "user", "content": value})
            sources.append(Source(text=True))
        else:
            items_at = len(messages)
            viewed, viewed_sources, covered = _input_view(value, namespace)
            messages.extend(viewed)
            sources.extend(viewed_sources)
        chat: dict[str, Any] = {"model": body["model"], "messages": messages}
        sent_tools = body.get("tools")
        tools = [t for t in tool_views(sent_tools, _tool_view, namespace) if t is not None] if sent_tools else []
        if tools:
            chat["tools"] = tools
        if isinstance(body.get("max_output_tokens"), int):
            chat["max_tokens"] = body["max_output_tokens"]
        for key in ("stream", "prompt_cache_key", "user", "cache_salt"):
            if key in body:
                chat[key] = body[key]
        if isinstance(value, str):
            return cls(body, chat, sources, actions)
        return cls(body, chat, sources, actions, items_at, covered)

    @property
    def previous_response_id(self) -> str | None:
        value = self.body.get("previous_response_id")
        return value if isinstance(value, str) else None

    def position(self, index: int) -> tuple[int | str | None, int | None]:
        """The client's input item (``"instructions"``, or 0 for a string ``input``)."""
        if not 0 <= index < len(self.sources):
            return None, None
        source = self.sources[index]
        if source.instructions:
            return "instructions", None
        if source.text:
            return 0, None
        return (source.items[0] if source.items else None), None

    def restore(self, forwarded: dict[str, Any]) -> dict[str, Any]:
        instructions, items = self.restore_input(forwarded["messages"])
        out = dict(self.body)
        if instructions is None:
            out.pop("instructions", None)
        else:
            out["instructions"] = instructions
        original = self.body["input"]
        text_only = len(items) == 1 and items[0] is _TEXT_INPUT
        out["input"] = (
            original if text_only else [{"role": "user", "content": original} if i is _TEXT_INPUT else i for i in items]
        )
        return out

    def _unchanged_lead(self, view: Sequence[Any], forwarded: Sequence[Any]) -> tuple[int, int]:
        """(view messages, items) that lead both lists unchanged, after instructions that alone changed;
        only messages made of their items in order (0, 0 where not known)."""
        covered = self.covered
        if covered is None:
            return 0, 0
        head = unchanged_lead(view, forwarded, system_first=self.items_at == 1)
        lead = min(head - self.items_at, len(covered) - 1)
        if lead <= 0:
            return 0, 0
        return self.items_at + lead, covered[lead]

    def restore_input(self, forwarded: Sequence[dict[str, Any]]) -> tuple[str | None, list[Any]]:
        """(instructions, input items) for these view messages; the string input stays a marker."""
        original_items = self.body["input"] if isinstance(self.body["input"], list) else []
        instructions = self.body.get("instructions") if isinstance(self.body.get("instructions"), str) else None
        viewed_instructions = bool(self.sources) and self.sources[0].instructions
        if viewed_instructions:
            instructions = None  # unless it comes through
        view_messages = self.chat["messages"]
        # The items whose view messages lead both lists unchanged: the client's own, taken at once.
        start, upto = self._unchanged_lead(view_messages, forwarded)
        if start and viewed_instructions:
            unchanged = same_message(forwarded[0], view_messages[0])
            instructions = self.body["instructions"] if unchanged else "".join(texts(forwarded[0].get("content")))
        out: list[Any] = list(original_items[:upto])
        viewed_items = {i for s in self.sources[start:] for i in s.items}
        pending_unviewed = [i for i in range(upto, len(original_items)) if i not in viewed_items]
        rest = align(view_messages[start:], forwarded[start:])
        for position, (message, aligned) in enumerate(zip(forwarded[start:], rest, strict=True), start):
            if aligned.view is not None:
                aligned = Aligned(aligned.view + start, aligned.changed)
            source = self.sources[aligned.view] if aligned.view is not None else None
            if source is not None and source.instructions and position == 0:
                instructions = (
                    self.body["instructions"] if not aligned.changed else "".join(texts(message.get("content")))
                )
                continue
            if source is None or source.instructions:
                out.extend(new_items(message))
                continue
            if source.text:
                out.append(_TEXT_INPUT if not aligned.changed else {"role": "user", "content": message.get("content")})
                continue
            items = source.items
            if pending_unviewed and pending_unviewed[0] < min(items):
                first = min(items)
                while pending_unviewed and pending_unviewed[0] < first:
                    out.append(original_items[pending_unviewed.pop(0)])
            if not aligned.changed:
                if len(items) == 1:
                    out.append(original_items[items[0]])
                else:
                    out.extend(original_items[i] for i in items)
            else:
                assert aligned.view is not None
                out.extend(_patched(original_items, source, view_messages[aligned.view], message))
        out.extend(original_items[i] for i in pending_unviewed)
        return instructions, out


@dataclass(slots=True)
class _InputView:
    """A request's input items and their view messages (``starts[m]``: the first item of message ``m``;
    ``covered``: as :attr:`ResponsesView.covered`)."""

    messages: list[dict[str, Any]]
    sources: list[Source]
    starts: list[int]
    covered: list[int]


# The last input of each conversation (per tenant), with what was derived from it (its validation
# passed, its view): the next request validates and views only what it adds. One memory for both
# parts: the second finds the list the first kept.
_INPUTS: Continuations[Any] = Continuations()


def _input_view(items: list[Any], namespace: str) -> tuple[list[dict[str, Any]], list[Any], list[int]]:
    """The view messages of ``items`` and their sources. The leading items that are the very objects
    the conversation's last request viewed take the views made then, up to the last message they
    made, which is viewed again (a function call or reasoning item that follows joins the assistant
    message before it). What goes upstream is made from this request's own items
    (:meth:`ResponsesView.restore_input` takes the client's item for each unchanged message)."""
    resumed = _INPUTS.resume(namespace, items, "view")
    kept: _InputView | None = resumed.state
    shared = resumed.identical()
    messages: list[dict[str, Any]] = []
    sources: list[Any] = []
    starts: list[int] = []
    covered = [0]
    start = 0
    if kept is not None and shared:
        # The messages made only of items before ``shared``, less the last of them (it may grow).
        whole = bisect_right(kept.starts, shared - 1) - 1
        if whole > 0:
            messages, sources, start = kept.messages[:whole], kept.sources[:whole], kept.starts[whole]
            starts, covered = kept.starts[:whole], kept.covered[: whole + 1]
    made = len(sources)  # the sources before are frozen already
    for index in range(start, len(items)):
        _add_item(items[index], index, messages, sources)
    sources[made:] = [Source(items=tuple(items)) for items in sources[made:]]
    starts.extend(source.items[0] if source.items else 0 for source in sources[made:])
    _extend_covered(covered, sources)  # a lead that stopped short stops at the same message again
    resumed.keep(items, _InputView(messages, sources, starts, covered))
    # Kept as they are from here on: the caller copies the messages and sources into its own lists.
    return messages, sources, covered


def _extend_covered(covered: list[int], sources: list[Source]) -> None:
    """``covered`` (one entry per message so far, and one) carried on while each next message is made
    of the next items in order; it stops at the first that is not (an item left unviewed, a call
    joined across one)."""
    for source in sources[len(covered) - 1 :]:
        items, first = source.items, covered[-1]
        if items != tuple(range(first, first + len(items))) or not items:
            return
        covered.append(first + len(items))


class _TextInput:
    def __repr__(self) -> str:
        return "<input string>"


_TEXT_INPUT: Any = _TextInput()


def _add_item(item: dict[str, Any], index: int, messages: list[dict[str, Any]], sources: list[Any]) -> None:
    kind = item.get("type")
    role = item.get("role")
    previous = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind == "function_call" or kind == "custom_tool_call":
        arguments = item.get("arguments") if kind == "function_call" else json.dumps({"input": item.get("input", "")})
        call = {
            "id": item.get("call_id") or "",
            "type": "function",
            "function": {"name": item.get("name") or "", "arguments": arguments or ""},
        }
        if previous is not None:
            previous.setdefault("tool_calls", []).append(call)
            sources[-1].append(index)
            return
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        sources.append([index])
    elif kind == "reasoning":
        if previous is not None:
            sources[-1].append(index)
            return
        messages.append({"role": "assistant", "content": None})
        sources.append([index])
    elif kind in ("function_call_output", "custom_tool_call_output"):
        messages.append({"role": "tool", "tool_call_id": item.get("call_id") or "", "content": item.get("output")})
        sources.append([index])
    elif role == "assistant":
        text = _assistant_text(item.get("content"))
        if previous is not None and previous.get("content") is None and not previous.get("tool_calls"):
            previous["content"] = text
            sources[-1].append(index)
            return
        messages.append({"role": "assistant", "content": text})
        sources.append([index])
    elif isinstance(role, str):
        messages.append({"role": role, "content": _content_view(item.get("content"), role in STABLE_ROLES)})
        sources.append([index])
    # Other items (item references, built-in tool calls) have no chat form the pipeline reads:
    # they go back in place, unviewed.


def _assistant_text(content: Any) -> Any:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        return content[0].get("text")
    return None


def _content_view(content: Any, stable: bool) -> Any:
    if not isinstance(content, list):
        return content
    parts: list[dict[str, Any]] = []
    for number, part in enumerate(content):
        if isinstance(part.get("type"), str) and part["type"] in _TEXT_PARTS and isinstance(part.get("text"), str):
            text_part: dict[str, Any] = {"type": "text", "text": part["text"]}
            if stable:
                text_part[PART_KEY] = number
            parts.append(text_part)
        else:
            parts.append(dict(part))
    return parts


def _tool_view(tool: Any) -> Any:
    """A function tool as chat's; None for another kind (a built-in tool: not rendered as chat's)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return None
    function = {"name": tool.get("name"), "description": tool.get("description"), "parameters": tool.get("parameters")}
    return sort_keys_deep({"type": "function", "function": function})


# -- back to items ---------------------------------------------------------------------------


def _patched(items: list[Any], source: Source, before: dict[str, Any], after: dict[str, Any]) -> list[Any]:
    role = after.get("role")
    originals = [items[i] for i in source.items]
    if role == "tool":
        item = dict(originals[0])
        if after.get("tool_call_id") != before.get("tool_call_id"):
            item["call_id"] = after.get("tool_call_id")
        if after.get("content") != before.get("content"):
            item["output"] = after.get("content")
        return [item]
    if role == "assistant":
        out = []
        calls = iter(c for c in after.get("tool_calls") or [] if isinstance(c, dict))
        old_calls = iter(c for c in before.get("tool_calls") or [] if isinstance(c, dict))
        for original in originals:
            item = dict(original)
            if item.get("type") in ("function_call", "custom_tool_call"):
                call, old = next(calls, None), next(old_calls, None)
                if call is not None and old is not None:
                    if call.get("id") != old.get("id"):
                        item["call_id"] = call.get("id")
                    arguments = (call.get("function") or {}).get("arguments")
                    if item.get("type") == "function_call" and arguments != (old.get("function") or {}).get(
                        "arguments"
                    ):
                        item["arguments"] = arguments
            elif item.get("role") == "assistant" and after.get("content") != before.get("content"):
                item["content"] = _with_text(item.get("content"), after.get("content"))
            out.append(item)
        return out
    item = dict(originals[0])
    content = after.get("content")
    original_content = item.get("content")
    if isinstance(original_content, list) and isinstance(content, list):
        item["content"] = _parts_back(original_content, content)
    elif isinstance(content, str) or content is None:
        item["content"] = content
    else:
        item["content"] = "".join(texts(content))
    return [item]


def _parts_back(original: list[Any], parts: list[Any]) -> list[Any]:
    out = []
    for position, part in enumerate(parts):
        number = part.get(PART_KEY) if isinstance(part, dict) else None
        if isinstance(number, int) and 0 <= number < len(original):
            source = original[number]
            out.append(source if source.get("text") == part.get("text") else {**source, "text": part.get("text")})
        elif isinstance(part, dict) and part.get("type") == "text":
            # A user part (no key): same position as the client's, unless parts were added.
            source = original[position] if position < len(original) else {"type": "input_text"}
            out.append({**source, "text": part.get("text")})
        else:
            out.append(part)
    return out


def _with_text(content: Any, text: Any) -> Any:
    if isinstance(content, list) and content and isinstance(content[0], dict):
        return [{**content[0], "text": "".join(texts(text))}, *content[1:]]
    return text


def new_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message the pipeline inserted, as Responses input items."""
    role = message.get("role")
    content = message.get("content")
    if role == "tool":
        return [{"type": "function_call_output", "call_id": message.get("tool_call_id") or "", "output": content or ""}]
    if role == "assistant":
        out: list[dict[str, Any]] = []
        text = "".join(texts(content))
        if text:
            out.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
        for call in message.get("tool_calls") or []:
            if isinstance(call, dict):
                function = call.get("function") or {}
                out.append(
                    {
                        "type": "function_call",
                        "call_id": call.get("id") or "",
                        "name": function.get("name") or "",
                        "arguments": function.get("arguments") or "",
                    }
                )
        return out
    if isinstance(content, list):
        content = [
            {"type": "input_text", "text": p.get("text", "")} if p.get("type") == "text" else p
            for p in content
            if isinstance(p, dict)
        ]
    return [{"role": role if role in ("system", "developer", "user") else "user", "content": content}]


# -- answers ---------------------------------------------------------------------------------


def read_usage(usage: Any) -> Usage | None:
    """Responses usage: ``input_tokens`` is the whole prompt, ``input_tokens_details.cached_tokens``
    what the prefix cache served."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(token_count(usage.get("input_tokens")), token_count(usage.get("output_tokens")), token_count(cached))


def reply_message(answer: Any) -> AssistantRecorder | None:
    if not isinstance(answer, dict) or not isinstance(answer.get("output"), list):
        return None
    recorder = AssistantRecorder()
    for item in answer["output"]:
        _record_item(recorder, item)
    return recorder


def _record_item(recorder: AssistantRecorder, item: Any) -> None:
    if not isinstance(item, dict):
        return
    if item.get("type") == "message":
        for part in item.get("content") or []:
            if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str):
                recorder.content_parts.append(part["text"])
    elif item.get("type") == "function_call":
        position = len(recorder.tool_calls)
        recorder.tool_calls[position] = ToolCall(
            str(item.get("call_id") or ""), str(item.get("name") or ""), str(item.get("arguments") or "")
        )


# The events that end a response.
_FINAL = frozenset({b"response.completed", b"response.incomplete", b"response.failed"})
_MARKS = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"', b'"response.created"')


_ANSWER_EVENTS = (b'"response.created"', b'"response.in_progress"', b'"response.completed"')


class ResponsesRelay(SSERelay):
    """Relays Responses events unchanged; the whole answer (usage, output, its id) is read from the
    last one (``response.completed``), the reply's text and calls from it too."""

    def _wants(self, complete: bytes) -> bool:
        return any(mark in complete for mark in _MARKS)

    def _is_final(self, complete: bytes) -> bool:
        return final_event(complete, _FINAL)

    def _annotate(self, block: bytes) -> bytes:
        """The answer fields go on each Response object the stream carries (created, in progress,
        completed: what the SDKs hand the client)."""
        fields = self._answer_fields
        if fields is None or not any(mark in block for mark in _ANSWER_EVENTS):
            return block
        out: list[bytes] = []
        for event in block.split(b"\n\n"):
            if event and any(mark in event for mark in _ANSWER_EVENTS):
                rewritten = with_data_fields(event, lambda payload: payload.get("response"), fields)
                event = rewritten if rewritten is not None else event
                if b'"response.completed"' in event:
                    self._answer_fields = None
            out.append(event)
        return b"\n\n".join(out)

    def _inspect(self, block: bytes) -> bytes:
        for payload in event_payloads(block):
            response = payload.get("response") if isinstance(payload, dict) else None
            if not isinstance(response, dict):
                continue
            if isinstance(response.get("id"), str):
                self.answer_id = response["id"]
            if payload.get("type") == "response.created":
                # The id is known before the answer is: recorded now, a client that chains on it
                # the moment the stream ends finds it.
                if self._on_answer is not None:
                    self._on_answer(response)
                continue
            self.answer = response
            usage = read_usage(response.get("usage"))
            if usage is not None:
                self.usage = usage
            for item in response.get("output") or []:
                _record_item(self.assistant, item)
        return block


# -- the summarizer's request ----------------------------------------------------------------


class ResponsesChannel:
    """Summaries of a Responses conversation go to ``/v1/responses``, stateless, rendered as it was."""

    path = "/responses"

    def __init__(self, view: ResponsesView) -> None:
        self._view = view

    def request(self, chat_body: dict[str, Any]) -> dict[str, Any]:
        instructions, items = self._view.restore_input(chat_body["messages"])
        original = self._view.body["input"]
        body: dict[str, Any] = {"model": chat_body["model"]}
        if instructions is not None:
            body["instructions"] = instructions
        body["input"] = [{"role": "user", "content": original} if i is _TEXT_INPUT else i for i in items]
        summary_options(body, self._view.body, "none")
        body.update(
            {"max_output_tokens": chat_body.get("max_tokens") or 512, "temperature": 0, "stream": False, "store": False}
        )
        return body

    def reply(self, answer: Any) -> tuple[str, Usage | None]:
        recorder = reply_message(answer)
        if recorder is None:
            raise KeyError("output")
        return recorder.content, read_usage(answer.get("usage"))


class Responses(GenerationProtocol):
    """``POST /v1/responses``."""

    route = "responses"
    path = "/responses"
    dialect = RESPONSES_API
    relay_class = ResponsesRelay
    answer_list = "output"

    def validate(self, body: dict[str, Any], namespace: str | None = None) -> None:
        validate_request(body, namespace or "")

    def view(self, body: dict[str, Any], tool_orders: ToolOrders | None, namespace: str) -> ResponsesView:
        return ResponsesView.of(body, tool_orders, namespace)

    def read_usage(self, usage: Any) -> Usage | None:
        return read_usage(usage)

    def reply_of(self, answer: Any) -> AssistantRecorder | None:
        return reply_message(answer)

    def channel(self, view: ResponsesView) -> ResponsesChannel:
        return ResponsesChannel(view)


RESPONSES = Responses()
