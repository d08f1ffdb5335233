"""Turning generated text into OpenAI tool calls, as vLLM's server does.

``parse_output`` mirrors what vLLM returns for each ``tool_choice``:

* ``"auto"`` (tools given, ``--enable-auto-tool-choice --tool-call-parser hermes``): the Hermes
  parser. Text before the first ``<tool_call>`` is the content (``None`` when empty); each
  ``<tool_call>{json}</tool_call>`` becomes a call whose ``arguments`` is
  ``json.dumps(parsed["arguments"], ensure_ascii=False)``. If any call fails to parse (e.g.
  cut by ``max_tokens``) the whole text is returned as content, as vLLM does.
* named ``{"type": "function", "function": {"name": N}}``: guided decoding makes the model emit
  the arguments object itself; the call is ``(N, generated text)`` and content is ``""``.
* ``"required"``: the model emits ``[{"name": ..., "parameters": {...}}, ...]``; each entry is
  a call with ``json.dumps(parameters, ensure_ascii=False)``; content is ``""``.
* ``"none"`` or no tools: no parsing, the text is the content.

``stream_deltas`` spreads the same result over the generated tokens the way vLLM streams it:
content as it arrives, then for each call one delta with ``id``/``type``/``function.name``
once the name is complete, then ``function.arguments`` fragments that concatenate to the
final arguments string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

ToolMode = Literal["none", "auto", "required", "named"]

_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str
    # Offset in the generated text once the name has been generated (streamed from there).
    name_end: int
    # Where ``arguments`` occurs verbatim in the text; None: sent in one piece at the end.
    arguments_span: tuple[int, int] | None


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: tuple[ParsedToolCall, ...] = ()
    # Text before this offset streams as content.
    content_end: int = 0
    tools_called: bool = field(default=False)


def parse_output(text: str, mode: ToolMode, named_function: str | None = None) -> ParsedOutput:
    if mode == "auto":
        return parse_hermes(text)
    if mode == "named":
        if named_function is None:
            raise ValueError("named tool choice needs a function name")
        call = ParsedToolCall(named_function, text, name_end=0, arguments_span=(0, len(text)))
        return ParsedOutput(content="", tool_calls=(call,), content_end=0, tools_called=True)
    if mode == "required":
        return _parse_required(text)
    return ParsedOutput(content=text, content_end=len(text))


def parse_hermes(text: str) -> ParsedOutput:
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ParsedOutput(content=text, content_end=len(text))
    calls: list[ParsedToolCall] = []
    try:
        for match in _HERMES_RE.finditer(text):
            group = 1 if match.group(1) else 2
            raw = match.group(group)
            parsed = json.loads(raw)
            calls.append(_locate(text, match.start(group), raw, parsed["name"], parsed["arguments"], "arguments"))
    except (ValueError, KeyError, TypeError):
        return ParsedOutput(content=text, content_end=len(text))
    content = text[:start]
    return ParsedOutput(content=content or None, tool_calls=tuple(calls), content_end=start, tools_called=True)


def _parse_required(text: str) -> ParsedOutput:
    try:
        entries = json.loads(text)
        if not isinstance(entries, list):
            raise ValueError("not a list")
        calls = [_locate(text, 0, text, entry["name"], entry["parameters"], "parameters") for entry in entries]
    except (ValueError, KeyError, TypeError):
        return ParsedOutput(content=text, content_end=len(text))
    return ParsedOutput(content="", tool_calls=tuple(calls), content_end=0, tools_called=True)


def _locate(text: str, base: int, raw: str, name: Any, arguments: Any, key: str) -> ParsedToolCall:
    if not isinstance(name, str):
        raise TypeError("tool call name must be a string")
    arguments_text = json.dumps(arguments, ensure_ascii=False)
    name_at = raw.find(json.dumps(name, ensure_ascii=False))
    name_end = base + (name_at + len(json.dumps(name, ensure_ascii=False)) if name_at >= 0 else len(raw))
    key_at = raw.find(f'"{key}"', max(name_at, 0))
    args_at = raw.find(arguments_text, key_at) if key_at >= 0 else -1
    span = (base + args_at, base + args_at + len(arguments_text)) if args_at >= 0 else None
    if span is not None and text[span[0] : span[1]] != arguments_text:
        span = None
    return ParsedToolCall(name, arguments_text, name_end, span)


def stream_deltas(
    parsed: ParsedOutput, token_texts: Sequence[str], tool_call_ids: Sequence[str]
) -> list[dict[str, Any] | None]:
    """One ``delta`` per generated token; ``None`` where vLLM sends no chunk for that token."""
    deltas: list[dict[str, Any] | None] = []
    name_sent = [False] * len(parsed.tool_calls)
    args_sent = [0] * len(parsed.tool_calls)  # offset up to which arguments went out
    end = 0
    last = len(token_texts) - 1
    for index, piece in enumerate(token_texts):
        start, end = end, end + len(piece)
        delta: dict[str, Any] = {}
        if not parsed.tools_called:
            delta["content"] = piece
        elif start < parsed.content_end:
            delta["content"] = piece[: parsed.content_end - start]
        entries: list[dict[str, Any]] = []
        for j, call in enumerate(parsed.tool_calls):
            entry: dict[str, Any] = {}
            if not name_sent[j] and (end >= call.name_end or index == last):
                entry = {
                    "index": j,
                    "id": tool_call_ids[j],
                    "type": "function",
                    "function": {"name": call.name},
                }
                name_sent[j] = True
            if name_sent[j]:
                fragment = _arguments_fragment(call, args_sent[j], end, final=index == last)
                if fragment:
                    args_sent[j] += len(fragment)
                    entry.setdefault("index", j)
                    entry.setdefault("function", {})["arguments"] = fragment
            if entry:
                entries.append(entry)
        if entries:
            delta["tool_calls"] = entries
        deltas.append(delta or None)
    return deltas


def _arguments_fragment(call: ParsedToolCall, sent: int, end: int, *, final: bool) -> str:
    if call.arguments_span is None:
        return call.arguments[sent:] if final else ""
    span_start, span_end = call.arguments_span
    available = max(0, min(end, span_end) - span_start)
    if final:
        available = len(call.arguments)
    return call.arguments[sent:available] if available > sent else ""
