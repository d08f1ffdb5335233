"""Anthropic Messages (``POST /v1/messages``) through the chat pipeline.

vLLM serves ``/v1/messages`` by converting the request to a chat completion
(``vllm/entrypoints/anthropic/serving.py``): the ``system`` text blocks joined into one
system message (Claude Code's ``x-anthropic-billing-header`` block dropped), ``tool_result``
blocks of a user message into ``tool`` messages ahead of the message's text, ``tool_use``
blocks into ``tool_calls`` with ``json.dumps(input)`` arguments, ``system`` messages inside
``messages`` kept where they are (merged into the leading one for templates that refuse them).

:class:`AnthropicView` builds that same chat conversation (the *view*) for the pipeline, and
maps the canonical view back onto the client's body (:meth:`AnthropicView.restore`): what is
unchanged is the client's own object, byte for byte (``cache_control`` breakpoints included);
a rewritten message is the client's message with only the rewritten fields replaced; inserted
system messages (moved volatile lines, a summary) become ``system`` messages in ``messages``,
which vLLM accepts and renders where they stand. Tools are canonicalized on the Anthropic body
itself (order by name, key order), which the view then mirrors.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.canon import ToolOrders, canonicalize_tool_fields
from proxy.http import (
    ANTHROPIC,
    CHECKED_MESSAGES,
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
from proxy.protocols.base import (
    Diagnosis,
    DiagnosticsAsk,
    GenerationProtocol,
    event_payloads,
    summary_options,
    texts,
    tool_views,
)

BILLING_HEADER = "x-anthropic-billing-header"
ROLES = frozenset({"user", "assistant", "system"})
# The key that ties a system text part of the view to the client's block (stripped on the way back).
BLOCK_KEY = "_block"


# -- validation ------------------------------------------------------------------------------


def validate_request(body: dict[str, Any], *, count_tokens: bool = False, namespace: str | None = None) -> None:
    """Types of everything the proxy reads (400 naming the parameter); the rest is vLLM's to judge.
    ``namespace``: the tenant, whose conversation's messages validated before are not validated again."""
    reading.MESSAGES.read(body)
    require_model(body)
    max_tokens = body.get("max_tokens")
    if not count_tokens and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
        raise InvalidRequest("'max_tokens' is required and must be an integer", param="max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    resumed = CHECKED_MESSAGES.resume(namespace, messages, "anthropic validation") if namespace is not None else None
    for index in range(resumed.shared if resumed is not None else 0, len(messages)):
        message = messages[index]
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{param} must be an object", param=param)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            shown = role if is_text(role) else type(role).__name__
            raise InvalidRequest(f"{param}.role {shown!r} is not a valid role"[:300], param=f"{param}.role")
        _validate_content(message.get("content"), f"{param}.content")
    system = body.get("system")
    if system is not None:
        _validate_content(system, "system")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest("'tools' must be an array", param="tools")
        for index, tool in enumerate(tools):
            param = f"tools[{index}]"
            if not isinstance(tool, dict):
                raise InvalidRequest(f"{param} must be an object", param=param)
            if "name" in tool and not isinstance(tool["name"], str):
                raise InvalidRequest(f"{param}.name must be a string", param=f"{param}.name")
            schema = tool.get("input_schema")
            if schema is not None and not isinstance(schema, dict):
                raise InvalidRequest(f"{param}.input_schema must be an object", param=f"{param}.input_schema")
    for key, kind, what in (("tool_choice", dict, "an object"), ("metadata", dict, "an object")):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise InvalidRequest(f"'{key}' must be {what}", param=key)
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    if resumed is not None:
        resumed.keep(messages, None)


def _validate_content(content: Any, param: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequest(f"{param} must be a string or an array of content blocks", param=param)
    for index, block in enumerate(content):
        where = f"{param}[{index}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise InvalidRequest(f"{where} must be a content block (an object with a 'type')", param=where)
        kind = block["type"]
        for key, types, what in _BLOCK_FIELDS.get(kind, ()):
            value = block.get(key)
            if value is not None and not isinstance(value, types):
                raise InvalidRequest(f"{where}.{key} must be {what}", param=f"{where}.{key}")
        if kind == "tool_result" and isinstance(block.get("content"), list):
            for item_index, item in enumerate(block["content"]):
                if not isinstance(item, dict):
                    raise InvalidRequest(f"{where}.content[{item_index}] must be an object", param=f"{where}.content")


_BLOCK_FIELDS: dict[str, tuple[tuple[str, type | tuple[type, ...], str], ...]] = {
    "text": (("text", str, "a string"),),
    "image": (("source", dict, "an object"),),
    "tool_use": (("id", str, "a string"), ("name", str, "a string"), ("input", dict, "an object")),
    "tool_result": (("tool_use_id", str, "a string"), ("content", (str, list), "a string or an array")),
    "thinking": (("thinking", str, "a string"),),
}


# -- the view --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Source:
    """What a view message was made from: a message of the client's body (None: ``system``) and
    the content blocks of it that went into the view message (empty: the content is a string)."""

    message: int | None
    blocks: tuple[int, ...] = ()


@dataclass
class AnthropicView:
    body: dict[str, Any]
    chat: dict[str, Any]
    sources: list[Source]
    actions: list[str] = field(default_factory=list)
    # The view messages of client message ``k`` are ``history_at + history_ends[k]`` up to
    # ``history_at + history_ends[k + 1]`` (None: not known, found from ``sources``).
    history_ends: list[int] | None = None
    history_at: int = 0

    @classmethod
    def of(cls, body: dict[str, Any], tool_orders: ToolOrders | None = None, namespace: str = "") -> AnthropicView:
        """The view of a validated request; its tools canonicalized first (on a copy), as the chat
        engine does (``tool_orders``: only an app's seen to vary; ``namespace``: the tenant)."""
        body = dict(body)
        actions = [str(action) for action in canonicalize_tool_fields(body, tool_orders, namespace)]
        messages: list[dict[str, Any]] = []
        sources: list[Source] = []
        system = body.get("system")
        if system is not None:
            converted = _system_view(system)
            if converted is not None:
                messages.append(converted[0])
                sources.append(Source(None, converted[1]))
        history_at = len(messages)
        history, history_sources, history_ends = _history_view(body["messages"], namespace)
        messages.extend(history)
        sources.extend(history_sources)
        chat: dict[str, Any] = {"model": body["model"], "messages": messages}
        tools = body.get("tools")
        if isinstance(tools, list) and tools:
            chat["tools"] = tool_views(tools, _tool_view, namespace)
        for key in ("max_tokens", "stream", "cache_salt"):
            if key in body:
                chat[key] = body[key]
        metadata = body.get("metadata")
        if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
            chat["user"] = metadata["user_id"]  # a session id only where sessions.use_user says so
        return cls(body, chat, sources, actions, history_ends, history_at)

    def _unchanged_lead(self, view: Sequence[Any], forwarded: Sequence[Any]) -> tuple[int, int]:
        """(view messages, client messages) that lead both lists unchanged, whole client messages only,
        after the system prompt where that alone changed (0, 0 where not known)."""
        ends = self.history_ends
        if ends is None:
            return 0, 0
        head = unchanged_lead(view, forwarded, system_first=self.history_at == 1)
        whole = bisect_right(ends, head - self.history_at) - 1
        if whole <= 0:
            return 0, 0
        return self.history_at + ends[whole], whole

    def viewed_once(self, index: int) -> bool:
        """Client message ``index`` made exactly one view message."""
        ends = self.history_ends
        if ends is None or not 0 <= index < len(ends) - 1:
            return len(self.viewed_as(index)) == 1
        return ends[index + 1] - ends[index] == 1

    def viewed_as(self, index: int) -> list[int]:
        """The view messages client message ``index`` made."""
        ends = self.history_ends
        if ends is None:
            return [k for k, source in enumerate(self.sources) if source.message == index]
        if not 0 <= index < len(ends) - 1:
            return []
        return list(range(self.history_at + ends[index], self.history_at + ends[index + 1]))

    def position(self, index: int) -> tuple[int | str | None, int | None]:
        """The client's message (``"system"``: the ``system`` field) and first content block."""
        if not 0 <= index < len(self.sources):
            return None, None
        source = self.sources[index]
        block = source.blocks[0] if source.blocks else None
        return ("system" if source.message is None else source.message), block

    # -- back to the client's protocol --------------------------------------------------------

    def restore(self, forwarded: dict[str, Any]) -> dict[str, Any]:
        """The client's body, with the canonical view's rewrites (and insertions) mapped onto it."""
        system, messages = self.restore_messages(forwarded["messages"])
        out = dict(self.body)
        if system is _ABSENT:
            out.pop("system", None)
        else:
            out["system"] = system
        out["messages"] = messages
        return out

    def restore_messages(self, forwarded: Sequence[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
        """(system, messages) for these view messages (``_ABSENT``: no ``system``)."""
        original_system = self.body.get("system", _ABSENT)
        viewed_system = bool(self.sources) and self.sources[0].message is None
        system: Any = _ABSENT if viewed_system else original_system
        if viewed_system:
            system = _system_rest(original_system, self.sources[0].blocks)
        view = self.chat["messages"]
        # The client messages whose every view message leads both lists unchanged: the client's own
        # objects, taken at once (a conversation's history, most of a long one).
        start, whole = self._unchanged_lead(view, forwarded)
        if start and viewed_system:
            if not same_message(forwarded[0], view[0]):
                system = _system_from(forwarded[0], original_system, self.sources[0].blocks)
            else:
                system = original_system
        out: list[dict[str, Any]] = list(self.body["messages"][:whole])
        builder = _MessageBuilder(self, out)
        rest = align(view[start:], forwarded[start:])
        for position, (message, aligned) in enumerate(zip(forwarded[start:], rest, strict=True), start):
            if aligned.view is not None:
                aligned = Aligned(aligned.view + start, aligned.changed)
            source = self.sources[aligned.view] if aligned.view is not None else None
            if source is not None and source.message is None and position == 0:
                system = (
                    original_system if not aligned.changed else _system_from(message, original_system, source.blocks)
                )
                continue
            if source is None or source.message is None:
                builder.flush()
                builder.add_new(message)
                continue
            assert aligned.view is not None
            if not aligned.changed and (not source.blocks or self.viewed_once(source.message)):
                builder.emit_unchanged(source.message)  # its one view message, unchanged
                continue
            builder.add(aligned.view, source, message, aligned.changed)
        builder.flush()
        return system, out


@dataclass(slots=True)
class _HistoryView:
    """A request's view of the client's messages: ``ends[k]``, the view messages the first ``k`` made."""

    messages: list[dict[str, Any]]
    sources: list[Source]
    ends: list[int]


# The last view of each conversation's messages (per tenant): the next request views only what it adds.
_VIEWED: Continuations[_HistoryView] = Continuations()


def _history_view(history: list[Any], namespace: str) -> tuple[list[dict[str, Any]], list[Source], list[int]]:
    """The view messages of the client's ``messages`` and their sources. The leading messages that are
    the very objects the conversation's last request viewed (a long body's history comes back as
    the same objects from the resumed parse, :mod:`proxy.openai.resumedjson`) take the views made
    then: what goes upstream is made from this request's own messages (:meth:`AnthropicView.restore`
    takes the client's object for each unchanged one), and nothing viewed from an object equal but not
    the same (``1`` for ``true``) is taken. Per request, work for the messages it adds."""
    resumed = _VIEWED.resume(namespace, history, "anthropic")
    kept = resumed.state
    shared = resumed.identical()
    if kept is not None and shared:
        end = kept.ends[shared]
        messages, sources, ends = kept.messages[:end], kept.sources[:end], kept.ends[: shared + 1]
    else:
        messages, sources, ends = [], [], [0]
    for index in range(shared, len(history)):
        for view_message, blocks in _message_view(history[index]):
            messages.append(view_message)
            sources.append(Source(index, blocks))
        ends.append(len(messages))
    resumed.keep(history, _HistoryView(messages, sources, ends))
    # Kept as they are from here on: the caller copies the messages and sources into its own lists.
    return messages, sources, ends


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT: Any = _Absent()


def _system_view(system: Any) -> tuple[dict[str, Any], tuple[int, ...]] | None:
    if isinstance(system, str):
        return ({"role": "system", "content": system}, ()) if system else None
    parts, blocks = _system_parts(system)
    if not parts:
        return None
    return {"role": "system", "content": parts}, blocks


def _system_parts(content: list[Any]) -> tuple[list[dict[str, Any]], tuple[int, ...]]:
    """The text blocks vLLM renders (non-empty, no billing header), as text parts that remember
    their block; vLLM joins them with nothing in between."""
    parts = []
    blocks = []
    for index, block in enumerate(content):
        text = block.get("text")
        if block.get("type") == "text" and isinstance(text, str) and text and not text.startswith(BILLING_HEADER):
            parts.append({"type": "text", "text": text, BLOCK_KEY: index})
            blocks.append(index)
    return parts, tuple(blocks)


def _message_view(message: dict[str, Any]) -> list[tuple[dict[str, Any], tuple[int, ...]]]:
    role, content = message["role"], message["content"]
    if isinstance(content, str):
        if role == "system" and (not content or content.startswith(BILLING_HEADER)):
            return []
        return [({"role": role, "content": content}, ())]
    if role == "system":
        system_parts, blocks = _system_parts(content)
        return [({"role": "system", "content": system_parts}, blocks)] if system_parts else []
    if role == "assistant":
        return _assistant_view(content)
    out: list[tuple[dict[str, Any], tuple[int, ...]]] = []
    parts: list[dict[str, Any]] = []
    part_blocks: list[int] = []
    for index, block in enumerate(content):
        kind = block["type"]
        if kind == "tool_result":
            out.append(
                (
                    {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": _tool_text(block)},
                    (index,),
                )
            )
        elif (part := _user_part(block)) is not None:
            parts.append(part)
            part_blocks.append(index)
    if parts:
        user_content: Any = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
        out.append(({"role": "user", "content": user_content}, tuple(part_blocks)))
    return out


def _user_part(block: dict[str, Any]) -> dict[str, Any] | None:
    kind = block["type"]
    if kind == "text" and block.get("text"):
        return {"type": "text", "text": block["text"]}
    if kind == "image" and isinstance(block.get("source"), dict):
        return {"type": "image_url", "image_url": {"url": image_url(block["source"])}}
    return None


def image_url(source: dict[str, Any]) -> str:
    """vLLM's conversion of an Anthropic image source (a URL, or base64 as a data URL)."""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(item.get("text", "")) for item in content if isinstance(item, dict) and item.get("type") == "text"
        )
    return ""


def _assistant_view(content: list[Any]) -> list[tuple[dict[str, Any], tuple[int, ...]]]:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id") or "",
                    "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})},
                }
            )
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    text: Any = None
    if len(parts) == 1:
        text = parts[0]["text"]
    elif parts:
        text = parts
    view: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        view["tool_calls"] = calls
    return [(view, tuple(range(len(content))))]


def _tool_view(tool: Any) -> Any:
    if not isinstance(tool, dict):
        return tool
    function = {
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("input_schema"),
    }
    # Already in canonical key order: the pipeline's own tool canonicalization finds nothing to do.
    return sort_keys_deep({"type": "function", "function": function})


# -- back: system ----------------------------------------------------------------------------


def _system_from(message: dict[str, Any], original: Any, viewed: tuple[int, ...]) -> Any:
    """The client's ``system`` with the view's rewritten text mapped onto its blocks."""
    content = message.get("content")
    if isinstance(original, str):
        return content if isinstance(content, str) else "".join(texts(content))
    return _blocks_from(content, original, viewed)


def _system_rest(original: Any, viewed: tuple[int, ...]) -> Any:
    """``system`` when the view's system message is gone (all of it moved): the blocks vLLM does
    not render stay (a billing header), or there is no ``system``."""
    if not isinstance(original, list):
        return _ABSENT
    rest = [block for index, block in enumerate(original) if index not in set(viewed)]
    return rest or _ABSENT


def _blocks_from(content: Any, original: list[Any], viewed: tuple[int, ...]) -> list[Any]:
    parts = content if isinstance(content, list) else [{"type": "text", "text": str(content or "")}]
    unviewed = [index for index in range(len(original)) if index not in set(viewed)]
    out: list[Any] = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        block_index = part.get(BLOCK_KEY)
        if isinstance(block_index, int) and 0 <= block_index < len(original):
            while unviewed and unviewed[0] < block_index:
                out.append(original[unviewed.pop(0)])
            block = original[block_index]
            out.append(block if block.get("text") == part.get("text") else {**block, "text": part.get("text", "")})
        else:
            out.append({"type": "text", "text": str(part.get("text", ""))})
    out.extend(original[index] for index in unviewed)
    return out


# -- back: messages --------------------------------------------------------------------------


class _MessageBuilder:
    """Collects the forwarded view messages of one client message and emits it: the client's own
    object when all of them came through unchanged, else the message rebuilt from its blocks."""

    def __init__(self, view: AnthropicView, out: list[dict[str, Any]]) -> None:
        self._view = view
        self._out = out
        self._message: int | None = None
        self._group: list[tuple[int, Source, dict[str, Any], bool]] = []
        self._emitted: set[int] = set()
        self._new_tool_message: dict[str, Any] | None = None

    def add(self, view_index: int, source: Source, message: dict[str, Any], changed: bool) -> None:
        if self._message is not None and source.message != self._message:
            self.flush()
        self._message = source.message
        self._new_tool_message = None
        self._group.append((view_index, source, message, changed))

    def flush(self) -> None:
        if self._message is None:
            return
        index, group = self._message, self._group
        self._message, self._group = None, []
        self._new_tool_message = None
        original = self._view.body["messages"][index]
        whole = [g[0] for g in group] == self._view.viewed_as(index)
        if whole and not any(changed for _, _, _, changed in group):
            self._out.append(original)
            self._emitted.add(index)
            return
        rebuilt = self._rebuild(index, original, group)
        if rebuilt is not None:
            self._out.append(rebuilt)
        self._emitted.add(index)

    def _rebuild(
        self, index: int, original: dict[str, Any], group: list[tuple[int, Source, dict[str, Any], bool]]
    ) -> dict[str, Any] | None:
        content = original["content"]
        if isinstance(content, str):
            message = group[0][2]
            new = message.get("content")
            if original["role"] == "system" or not isinstance(new, str):
                new = "".join(texts(new)) if not isinstance(new, str) else new
            return original if new == content else {**original, "content": new}
        replaced: dict[int, Any] = {}
        present: set[int] = set()
        view_messages = self._view.chat["messages"]
        for view_index, source, message, changed in group:
            present.update(source.blocks)
            if changed:
                replaced.update(_patched_blocks(original, source, view_messages[view_index], message))
        all_viewed = {b for vi in self._view.viewed_as(index) for b in self._view.sources[vi].blocks}
        blocks: list[Any] = []
        first_part = index not in self._emitted
        for block_index, block in enumerate(content):
            if block_index in replaced:
                blocks.extend(replaced[block_index])
            elif block_index in present or (block_index not in all_viewed and first_part):
                blocks.append(block)
        if not blocks:
            return None
        return {**original, "content": blocks}

    def emit_unchanged(self, index: int) -> None:
        """Client message ``index``, whose one view message came through unchanged: the client's own
        object (what :meth:`add` then :meth:`flush` give it, without the group)."""
        self.flush()
        self._new_tool_message = None
        self._out.append(self._view.body["messages"][index])
        self._emitted.add(index)

    def add_new(self, message: dict[str, Any]) -> None:
        """A message the pipeline inserted: a system message (moved lines, a summary), or turns
        restored from the session (window repair), converted to the client's protocol."""
        role = message.get("role")
        content = message.get("content")
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": message.get("tool_call_id") or "", "content": content or ""}
            if self._new_tool_message is not None:
                self._new_tool_message["content"].append(block)
                return
            self._new_tool_message = {"role": "user", "content": [block]}
            self._out.append(self._new_tool_message)
            return
        self._new_tool_message = None
        if role in STABLE_ROLES:
            self._out.append(
                {"role": "system", "content": content if isinstance(content, str) else "".join(texts(content))}
            )
        elif role == "assistant":
            self._out.append({"role": "assistant", "content": assistant_blocks(message)})
        else:
            self._out.append({"role": "user", "content": _user_blocks(content)})


def _patched_blocks(
    original: dict[str, Any], source: Source, before: dict[str, Any], after: dict[str, Any]
) -> dict[int, list[Any]]:
    """Block index -> the blocks replacing it, for a view message the pipeline rewrote."""
    content = original["content"]
    role = after.get("role")
    out: dict[int, list[Any]] = {}
    if role == "tool":
        (index,) = source.blocks
        block = dict(content[index])
        if after.get("tool_call_id") != before.get("tool_call_id"):
            block["tool_use_id"] = after.get("tool_call_id")
        if after.get("content") != before.get("content"):
            block["content"] = after.get("content")
        out[index] = [block]
        return out
    if role == "system":
        blocks = _blocks_from(after.get("content"), content, source.blocks)
        viewed = [i for i in source.blocks]
        if viewed:
            out[viewed[0]] = blocks
            for index in viewed[1:]:
                out[index] = []
        return out
    text_indices = [i for i in source.blocks if content[i].get("type") == "text" and content[i].get("text")]
    new_texts = texts(after.get("content"))
    if new_texts != texts(before.get("content")):
        if len(new_texts) == len(text_indices):
            for index, text in zip(text_indices, new_texts, strict=True):
                if content[index].get("text") != text:
                    out[index] = [{**content[index], "text": text}]
        elif text_indices:
            out[text_indices[0]] = [{"type": "text", "text": "".join(new_texts)}]
            for index in text_indices[1:]:
                out[index] = []
    if role == "assistant":
        use_indices = [i for i in source.blocks if content[i].get("type") == "tool_use"]
        calls = [c for c in after.get("tool_calls") or [] if isinstance(c, dict)]
        old_calls = [c for c in before.get("tool_calls") or [] if isinstance(c, dict)]
        for index, call, old in zip(use_indices, calls, old_calls, strict=False):
            block = dict(content[index])
            if call.get("id") != old.get("id"):
                block["id"] = call.get("id")
            arguments = (call.get("function") or {}).get("arguments")
            if arguments != (old.get("function") or {}).get("arguments"):
                parsed = _object(arguments)
                if parsed is not None:
                    block["input"] = parsed
            if block != content[index]:
                out[index] = [block]
    return out


def assistant_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat assistant message as Anthropic content blocks."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text} for text in texts(message.get("content")) if text]
    for call in message.get("tool_calls") or []:
        if not isinstance(call, dict):
            continue
        function = call.get("function") or {}
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": function.get("name") or "",
                "input": _object(function.get("arguments")) or {},
            }
        )
    return blocks or [{"type": "text", "text": ""}]


def _user_blocks(content: Any) -> Any:
    if isinstance(content, str) or not isinstance(content, list):
        return content if isinstance(content, str) else ""
    blocks: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "text":
            blocks.append({"type": "text", "text": part.get("text", "")})
        elif part.get("type") == "image_url":
            url = str((part.get("image_url") or {}).get("url", ""))
            blocks.append({"type": "image", "source": _image_source(url)})
    return blocks


def _image_source(url: str) -> dict[str, Any]:
    if url.startswith("data:") and ";base64," in url:
        media_type, data = url[5:].split(";base64,", 1)
        return {"type": "base64", "media_type": media_type, "data": data}
    return {"type": "url", "url": url}


def _object(arguments: Any) -> dict[str, Any] | None:
    if not isinstance(arguments, str):
        return None
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# -- answers ---------------------------------------------------------------------------------


def read_usage(usage: Any) -> Usage | None:
    """Anthropic usage: ``input_tokens`` excludes what was read from or written to the cache."""
    if not isinstance(usage, dict):
        return None
    read = token_count(usage.get("cache_read_input_tokens"))
    created = token_count(usage.get("cache_creation_input_tokens"))
    return Usage(
        prompt_tokens=token_count(usage.get("input_tokens")) + read + created,
        completion_tokens=token_count(usage.get("output_tokens")),
        cached_tokens=read,
    )


def reply_message(answer: Any) -> AssistantRecorder | None:
    """The assistant's reply in an Anthropic answer, as the pipeline records replies."""
    if not isinstance(answer, dict) or not isinstance(answer.get("content"), list):
        return None
    recorder = AssistantRecorder()
    for block in answer["content"]:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            recorder.content_parts.append(block["text"])
        elif block.get("type") == "tool_use":
            position = len(recorder.tool_calls)
            recorder.tool_calls[position] = ToolCall(
                str(block.get("id") or ""), str(block.get("name") or ""), json.dumps(block.get("input") or {})
            )
    return recorder


_MARKS = (b'"message_start"', b'"message_delta"', b'"content_block_start"', b'"input_json_delta"')


_STOP = frozenset({b"message_stop"})


class AnthropicRelay(SSERelay):
    """Relays Anthropic SSE events unchanged, reading usage (``message_start``, ``message_delta``),
    tool calls and (when recording) text as they pass."""

    # The usage fields said so far (replaced, never changed in place: the class's empty one is shared).
    _usage_fields: dict[str, Any] = {}  # noqa: RUF012

    def _wants(self, complete: bytes) -> bool:
        return self._record_content or any(mark in complete for mark in _MARKS)

    def _read_usage(self, fields: Any) -> None:
        """Anthropic's usage counts are cumulative over the stream, each event giving some of them:
        ``message_start`` the input, ``message_delta`` the output (llama-server's gives the output
        alone, Anthropic's repeats the input). What an event leaves out is what was said before."""
        if not isinstance(fields, dict):
            return
        said = {**self._usage_fields, **{key: value for key, value in fields.items() if value is not None}}
        self._usage_fields = said
        usage = read_usage(said)
        if usage is not None:
            self.usage = usage

    def _is_final(self, complete: bytes) -> bool:
        return final_event(complete, _STOP)

    def _inspect(self, block: bytes) -> bytes:
        for payload in event_payloads(block):
            if isinstance(payload, dict):
                self._read(payload)
        return block

    def _annotate(self, block: bytes) -> bytes:
        """The answer fields go on the message ``message_start`` carries (the SDKs' Message)."""
        if b'"message_start"' not in block:
            return block
        out: list[bytes] = []
        for event in block.split(b"\n\n"):
            if event and self._answer_fields is not None and b'"message_start"' in event:
                rewritten = with_data_fields(event, lambda payload: payload.get("message"), self._answer_fields)
                if rewritten is not None:
                    event, self._answer_fields = rewritten, None
            out.append(event)
        return b"\n\n".join(out)

    def _read(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            if isinstance(event["message"].get("id"), str):
                self.answer_id = event["message"]["id"]
            self._read_usage(event["message"].get("usage"))
        elif kind == "message_delta":
            self._read_usage(event.get("usage"))
        elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            block = event["content_block"]
            index = event.get("index")
            if block.get("type") == "tool_use" and isinstance(index, int):
                self.assistant.tool_calls[index] = ToolCall(str(block.get("id") or ""), str(block.get("name") or ""))
            elif block.get("type") == "text" and isinstance(block.get("text"), str) and block["text"]:
                self.assistant.content_parts.append(block["text"])
        elif kind == "content_block_delta" and isinstance(event.get("delta"), dict):
            delta = event["delta"]
            index = event.get("index")
            if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                self.assistant.content_parts.append(delta["text"])
            elif delta.get("type") == "input_json_delta" and isinstance(delta.get("partial_json"), str):
                call = self.assistant.tool_calls.get(index) if isinstance(index, int) else None
                if call is not None:
                    call.arguments += delta["partial_json"]


# -- the summarizer's request ----------------------------------------------------------------


class AnthropicChannel:
    """Summaries of an Anthropic conversation go to ``/v1/messages``, rendered as it was."""

    path = "/messages"

    def __init__(self, view: AnthropicView) -> None:
        self._view = view

    def request(self, chat_body: dict[str, Any]) -> dict[str, Any]:
        system, messages = self._view.restore_messages(chat_body["messages"])
        body: dict[str, Any] = {"model": chat_body["model"], "max_tokens": chat_body.get("max_tokens") or 512}
        if system is not _ABSENT:
            body["system"] = system
        body["messages"] = messages
        summary_options(body, self._view.body, {"type": "none"})
        body["temperature"] = chat_body.get("temperature", 0)
        return body

    def reply(self, answer: Any) -> tuple[str, Usage | None]:
        if not isinstance(answer, dict) or not isinstance(answer.get("content"), list):
            raise KeyError("content")
        text = "".join(b.get("text", "") for b in answer["content"] if isinstance(b, dict) and b.get("type") == "text")
        return text, read_usage(answer.get("usage"))


class AnthropicMessages(GenerationProtocol):
    """``POST /v1/messages``."""

    route = "messages"
    path = "/messages"
    dialect = ANTHROPIC
    relay_class = AnthropicRelay
    answer_list = "content"

    def validate(self, body: dict[str, Any], namespace: str | None = None) -> None:
        validate_request(body, namespace=namespace)

    def view(self, body: dict[str, Any], tool_orders: ToolOrders | None, namespace: str) -> AnthropicView:
        return AnthropicView.of(body, tool_orders, namespace)

    def read_usage(self, usage: Any) -> Usage | None:
        return read_usage(usage)

    def reply_of(self, answer: Any) -> AssistantRecorder | None:
        return reply_message(answer)

    def channel(self, view: AnthropicView) -> AnthropicChannel:
        return AnthropicChannel(view)

    def diagnostics_asked(self, body: dict[str, Any]) -> tuple[dict[str, Any], DiagnosticsAsk | None]:
        """``diagnostics: {previous_message_id}`` (``null`` on a conversation's first turn)."""
        asked = body.get("diagnostics")
        if "diagnostics" not in body:
            return body, None
        body = {key: value for key, value in body.items() if key != "diagnostics"}
        previous = asked.get("previous_message_id") if isinstance(asked, dict) else None
        return body, DiagnosticsAsk(previous if isinstance(previous, str) and previous else None)

    def diagnostics_fields(self, diagnosis: Diagnosis) -> dict[str, Any]:
        """``diagnostics: {cache_miss_reason}``: null for a hit and for a first turn (nothing to
        compare with), else the reason and the input tokens that missed."""
        reason: dict[str, Any] | None
        if diagnosis.outcome in ("hit", "not_compared"):
            reason = None
        elif diagnosis.outcome == "not_found":
            reason = {"type": "previous_message_not_found"}
        elif diagnosis.outcome == "unavailable":
            reason = {"type": "unavailable"}
        else:
            changed = "messages" if diagnosis.changed == "compacted" else diagnosis.changed
            reason = {
                "type": f"{changed}_changed",
                "cache_missed_input_tokens": diagnosis.missed_tokens,
                "divergence": diagnosis.divergence(),
            }
        return {"diagnostics": {"cache_miss_reason": reason}}


MESSAGES = AnthropicMessages()
