"""The canonicalization engine: request -> (canonical request, actions). No I/O.

Stages, in order:
1. tools, tool_choice, functions, response_format: canonical order and JSON, for an app
   seen to send them in varying order (``tools.ToolOrders``);
2. (opt-in) whitespace / Unicode normalization of client-authored text;
3. history tool calls: exact ids and argument bytes the backend generated;
4. (``relocate`` mode) volatile lines of the leading system prompt moved behind
   the stable part, whole lines, byte for byte: detectors, user rules and learned
   volatility name candidates, and a candidate moves only once its place has been
   seen to vary (``varying``); a conversation forwarded with its lines in place
   keeps them there, and lines inserted before one of its user turns go there again
   (``layout``). A moved block that only restates the user's question is re-created
   in front of earlier questions too, as those turns were forwarded
   (``querytemplate``). See ``relocation``.

The input is never mutated. Apart from the optional memories passed in, the result
depends only on the input, and ``canonicalize(canonicalize(x)) == canonicalize(x)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, count, repeat
from operator import eq, methodcaller, not_
from typing import Any

from proxy.canon.actions import Action
from proxy.canon.fingerprint import leading_system_count, stable_prefix_hash
from proxy.canon.layout import ForwardedLayouts
from proxy.canon.learned import LearnedVolatility
from proxy.canon.normalize import NormalTextMemo, normalize_messages
from proxy.canon.relocation import Memories, Placement, relocate
from proxy.canon.textmemo import TextMemo
from proxy.canon.toolcalls import ToolCallMemory, restore_tool_calls
from proxy.canon.tools import ToolOrders, canonicalize_tool_fields
from proxy.canon.varying import VaryingPlaces
from proxy.canon.volatile import BUILTIN_DETECTORS, DetectionCache, Detector
from proxy.config import CanonMode, RelocateTarget


@dataclass(frozen=True)
class CanonOptions:
    mode: CanonMode = "relocate"
    relocate_target: RelocateTarget = "before_last_user"
    # Re-formatting text the backend has not seen yet is opt-in: it changes what the model is told.
    normalize_whitespace: bool = False
    normalize_unicode: bool = False
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
    # Indices into ``body["messages"]`` of the messages canonicalization made (a block of moved
    # volatile lines, a restated question): text the client sent, but not as a message of its own.
    inserted: tuple[int, ...] = ()

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
    varying: VaryingPlaces | None = None,
    layouts: ForwardedLayouts | None = None,
    tool_orders: ToolOrders | None = None,
    text_memo: TextMemo | None = None,
) -> CanonResult:
    """Canonicalize a chat-completions body. ``namespace`` (the tenant) scopes the memories.

    Without ``varying`` every detected span counts as varying (moved at first sight); without
    ``layouts`` a block always goes to its default place; without ``tool_orders`` tools are always
    put in canonical order (with it, only an app's seen to arrive in another order).

    ``detection_cache``, ``normal_texts`` and ``text_memo`` only save work (the first two must
    belong to these ``options``); the result does not depend on them.
    """
    if options.mode == "off" or not isinstance(body.get("messages"), list):
        count = leading_system_count(body.get("messages") or [])
        return CanonResult(body, [], stable_prefix_hash(body, count), count)
    out = dict(body)
    normalizing = options.normalize_whitespace or options.normalize_unicode
    # A step that changes a message replaces it in the list (the messages the client sent are
    # never changed in place): a copy of the list is enough, and what stays is the client's own
    # objects, found again by identity by the parts that resume a conversation. Normalization
    # changes texts in place: it works on copies.
    messages = [_copy_message(m) for m in body["messages"]] if normalizing else list(body["messages"])
    out["messages"] = messages
    actions = canonicalize_tool_fields(out, tool_orders, namespace)

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
    relocation = None
    if options.mode == "relocate":
        placement = Placement(options.relocate_target, options.restore_query_blocks, options.detectors)
        texts = text_memo.scope(namespace, options.detectors) if text_memo is not None else None
        memories = Memories(learned, varying, layouts, detection_cache, texts)
        relocation = relocate(out, messages, placement, memories, namespace)
        actions.extend(relocation.actions)
        stable_count, system_tail = relocation.stable_count, relocation.system_tail

    inserted: tuple[int, ...] = ()
    if len(messages) != len(body["messages"]):
        # Where relocation put what it made, less any equal to a system message the client sent
        # (normalized copies are not what the client sent: looked for among all).
        placed = relocation.inserted if relocation is not None and not normalizing else None
        sent_system = relocation.sent_system if relocation is not None else None
        if placed is not None and sent_system is not None:
            inserted = tuple(index for index in placed if messages[index] not in sent_system)
        else:
            inserted = _inserted(body["messages"], messages, stable_count)
    return CanonResult(out, actions, stable_prefix_hash(out, stable_count), stable_count, system_tail, inserted)


def _inserted(sent: list[Any], canonical: list[Any], stable_count: int) -> tuple[int, ...]:
    """System messages after the stable prefix that the client did not send (relocation only ever
    inserts system messages there; one equal to a message the client sent counts as the client's).
    Only the messages that are not the client's own objects are looked at (found in C)."""
    own = set(map(id, sent))
    made = compress(count(stable_count), map(not_, map(own.__contains__, map(id, canonical[stable_count:]))))
    systems = [
        index for index in made if isinstance(canonical[index], dict) and canonical[index].get("role") == "system"
    ]
    if not systems:
        return ()
    try:  # the client's system messages, found in C (a history holds few or none past the prompt)
        sent_system = list(compress(sent, map(eq, map(_ROLE, sent), repeat("system"))))
    except AttributeError:  # not every message is an object
        sent_system = [m for m in sent if isinstance(m, dict) and m.get("role") == "system"]
    return tuple(index for index in systems if canonical[index] not in sent_system)


_ROLE = methodcaller("get", "role")


def _copy_message(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    copied = dict(message)
    content = copied.get("content")
    if isinstance(content, list):
        copied["content"] = [dict(p) if isinstance(p, dict) else p for p in content]
    return copied
