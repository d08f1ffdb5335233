"""The canonicalization engine: request -> (canonical request, actions). No I/O.

Stages, in order:
1. tools, tool_choice, functions, response_format: canonical order and JSON;
2. whitespace / Unicode normalization of client-authored text;
3. history tool calls: exact ids and argument bytes the backend generated;
4. (``relocate`` mode) volatile lines of the leading system prompt moved behind
   the stable part: detectors, user rules and learned volatility decide which; a
   moved block that only restates the user's question is re-created in front of
   earlier questions too, as those turns were forwarded (``querytemplate``).

The input is never mutated. Apart from the optional learned-volatility and
tool-call memories passed in, the result depends only on the input, and
``canonicalize(canonicalize(x)) == canonicalize(x)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.canon.actions import Action
from proxy.canon.fingerprint import leading_system_count, stable_prefix_hash
from proxy.canon.learned import LearnedVolatility
from proxy.canon.normalize import NormalTextMemo, normalize_messages
from proxy.canon.querytemplate import restore_query_blocks
from proxy.canon.relocate import is_text_parts, lines_touched, partition_lines, split_lines
from proxy.canon.toolcalls import ToolCallMemory, restore_tool_calls
from proxy.canon.tools import canonicalize_tool_fields
from proxy.canon.volatile import BUILTIN_DETECTORS, DetectionCache, Detector, Span, detect_spans

Mode = Literal["off", "safe", "relocate"]
Target = Literal["before_last_user", "system_end"]


@dataclass(frozen=True)
class CanonOptions:
    mode: Mode = "relocate"
    relocate_target: Target = "before_last_user"
    normalize_whitespace: bool = True
    normalize_unicode: bool = True
    # Re-create a moved block that only restates the user's question before earlier questions too.
    restore_query_blocks: bool = True
    detectors: Sequence[Detector] = field(default_factory=lambda: tuple(BUILTIN_DETECTORS.values()))


@dataclass
class CanonResult:
    body: dict[str, Any]
    actions: list[Action]
    prefix_hash: str
    # Leading system messages that are stable (what a summary goes right after).
    stable_count: int = 0
    # Volatile lines moved to the end of the last stable system message (relocate_target system_end),
    # which a summary merged into that message must go before.
    system_tail: str = ""

    @property
    def changed(self) -> bool:
        return bool(self.actions)


def canonicalize(
    body: dict[str, Any],
    options: CanonOptions,
    *,
    namespace: str = "",
    learned: LearnedVolatility | None = None,
    tool_memory: ToolCallMemory | None = None,
    detection_cache: DetectionCache | None = None,
    normal_texts: NormalTextMemo | None = None,
) -> CanonResult:
    """Canonicalize a chat-completions body. ``namespace`` (the tenant) scopes the memories.

    ``detection_cache`` and ``normal_texts`` only save work (each must belong to these
    ``options``); the result does not depend on them.
    """
    if options.mode == "off" or not isinstance(body.get("messages"), list):
        count = leading_system_count(body.get("messages") or [])
        return CanonResult(body, [], stable_prefix_hash(body, count), count)
    out = dict(body)
    messages = [_copy_message(m) for m in body["messages"]]
    out["messages"] = messages
    actions = canonicalize_tool_fields(out)

    if options.normalize_whitespace or options.normalize_unicode:
        changed = normalize_messages(
            messages,
            whitespace=options.normalize_whitespace,
            unicode=options.normalize_unicode,
            memo=normal_texts,
        )
        if changed:
            actions.append(Action("text_normalized", str(changed)))

    actions.extend(restore_tool_calls(messages, namespace, tool_memory))

    stable_count = leading_system_count(messages)
    system_tail = ""
    if options.mode == "relocate":
        app_key = _app_key(namespace, out)
        relocation, stable_count, system_tail = _relocate_volatile(messages, options, learned, app_key, detection_cache)
        actions.extend(relocation)

    return CanonResult(out, actions, stable_prefix_hash(out, stable_count), stable_count, system_tail)


def _copy_message(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    copied = dict(message)
    content = copied.get("content")
    if isinstance(content, list):
        copied["content"] = [dict(p) if isinstance(p, dict) else p for p in content]
    return copied


def _app_key(namespace: str, body: dict[str, Any]) -> str:
    tools = body.get("tools") or body.get("functions") or []
    names = ",".join(str((t.get("function") or t).get("name", "")) if isinstance(t, dict) else "" for t in tools)
    return f"{namespace}\x00{body.get('model', '')}\x00{names}"


def _relocate_volatile(
    messages: list[dict[str, Any]],
    options: CanonOptions,
    learned: LearnedVolatility | None,
    app_key: str,
    detection_cache: DetectionCache | None = None,
) -> tuple[list[Action], int, str]:
    """Returns the actions, how many leading system messages are now stable, and the volatile lines
    moved to the end of the last of them (system_end)."""
    system_count = leading_system_count(messages)
    if system_count == 0:
        return [], 0, ""
    system_tail = ""
    stable_count = system_count
    to_end = options.relocate_target == "system_end" or not _has_user_after(messages, system_count)
    actions: list[Action] = []
    moved_blocks: list[str] = []
    emptied: list[int] = []
    detected = False
    for index in range(system_count):
        content = messages[index].get("content")
        key = f"{app_key}\x00{index}"
        if isinstance(content, str):
            split = _split_text(content, options, learned, key, detection_cache)
        elif is_text_parts(content):
            split = _split_parts(content, options, learned, key, detection_cache)
        else:
            continue
        if split.learned:
            actions.append(Action("learned_volatile_lines", str(split.learned)))
        stable, moved, spans = split.stable, split.moved, split.spans
        if not moved:
            continue
        if to_end:
            new_content = _append_text(stable, moved)
            if new_content != content:
                messages[index] = {**messages[index], "content": new_content}
                actions.extend(_span_actions(spans))
                actions.append(Action("volatile_moved", "system_end"))
            if index == system_count - 1 and stable:
                system_tail = moved
            continue
        if not stable and index == system_count - 1 and _last_user_index(messages) == system_count:
            # A wholly volatile last system message right before the only user turn is already in place.
            stable_count = index
            continue
        actions.extend(_span_actions(spans))
        detected = detected or bool(spans)
        moved_blocks.append(moved)
        if stable:
            messages[index] = {**messages[index], "content": stable}
        else:
            emptied.append(index)
    if moved_blocks:
        block = "\n\n".join(moved_blocks)
        messages.insert(_last_user_index(messages), {"role": "system", "content": block})
        for index in reversed(emptied):
            del messages[index]
        stable_count = system_count - len(emptied)
        actions.append(Action("volatile_moved", "before_last_user"))
        if options.restore_query_blocks and not detected:
            # Only learned lines: detected spans (dates, retrieved context) are not a restatement.
            restored = restore_query_blocks(messages, block, stable_count, _last_user_index(messages))
            if restored:
                actions.append(Action("query_blocks_restored", str(restored)))
    return actions, stable_count, system_tail


@dataclass
class _Split:
    """A system message's content with its volatile lines taken out (``moved``: "" when none)."""

    stable: str | list[Any]
    moved: str = ""
    spans: list[Span] = field(default_factory=list)
    learned: int = 0


def _split_text(
    text: str,
    options: CanonOptions,
    learned: LearnedVolatility | None,
    key: str,
    detection_cache: DetectionCache | None,
) -> _Split:
    if not text:
        return _Split(text)
    spans = detect_spans(text, options.detectors, detection_cache)
    lines = split_lines(text)
    volatile = lines_touched(text, spans)
    learned_lines: set[int] = set()
    if learned is not None:
        learned_lines = _reindex(lines, volatile, learned.observe(key, _without(lines, volatile)))
        volatile |= learned_lines
    if not volatile:
        return _Split(text, learned=len(learned_lines))
    stable, moved = partition_lines(lines, volatile)
    if not moved:
        return _Split(text, learned=len(learned_lines))
    return _Split(stable, moved, spans, len(learned_lines))


def _split_parts(
    parts: list[dict[str, Any]],
    options: CanonOptions,
    learned: LearnedVolatility | None,
    key: str,
    detection_cache: DetectionCache | None,
) -> _Split:
    """Content given as text parts (``[{"type": "text", "text": ...}]``): each part is split like a
    string; parts keep their order, a part left empty is dropped, and the moved lines of all parts
    form one block, joined as the lines of one text are (so a second pass changes nothing)."""
    kept: list[Any] = []
    out = _Split(kept)
    moved: list[str] = []
    for number, part in enumerate(parts):
        split = _split_text(part["text"], options, learned, f"{key}\x00{number}", detection_cache)
        out.learned += split.learned
        if not split.moved:
            kept.append(part)
            continue
        moved.append(split.moved)
        out.spans.extend(split.spans)
        if split.stable:
            kept.append({**part, "text": split.stable})
    out.moved = "\n".join(moved)  # as partition_lines joins the moved lines of one text
    return out


def _append_text(stable: str | list[Any], moved: str) -> str | list[Any]:
    if isinstance(stable, list):
        return [*stable, {"type": "text", "text": moved}]
    return f"{stable}\n\n{moved}" if stable else moved


def _without(lines: list[str], excluded: set[int]) -> list[str]:
    return [line for i, line in enumerate(lines) if i not in excluded]


def _reindex(lines: list[str], excluded: set[int], learned: set[int]) -> set[int]:
    """Map indices into the reduced line list back to indices into ``lines``."""
    kept = [i for i in range(len(lines)) if i not in excluded]
    return {kept[i] for i in learned}


def _span_actions(spans: list[Span]) -> list[Action]:
    counts: dict[str, int] = {}
    for span in spans:
        counts[span.kind] = counts.get(span.kind, 0) + 1
    return [Action(f"volatile_{kind}", str(n)) for kind, n in sorted(counts.items())]


def _has_user_after(messages: list[dict[str, Any]], start: int) -> bool:
    return any(m.get("role") == "user" for m in messages[start:])


def _last_user_index(messages: list[dict[str, Any]]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "user":
            return index
    return len(messages)
