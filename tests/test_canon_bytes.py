"""Byte for byte: the default pipeline moves whole lines and restores what the backend saw, nothing else.

Hypothesis draws client requests with the text real clients send (blank lines, trailing blanks,
tabs, CRLF, text that is not in NFC, code fences, dates, times, ids and ``<context>`` blocks at
the top, in the middle and at the end, system prompts as text parts) and checks what reaches the
backend: every client-written line arrives whole and byte-exact, exactly as often as it was sent;
every detected span arrives byte-identical; non-system messages arrive untouched and in order;
and a conversation in which nothing varies arrives exactly as the client sent it, every turn.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.canon import CanonOptions, canonicalize
from proxy.canon.canonicalizer import Canonicalizer
from proxy.canon.volatile import BUILTIN_DETECTORS, detect_spans
from proxy.config import CanonSettings

PLAIN_LINES = st.sampled_from(
    [
        "You are a helpful assistant.",
        "Answer in the user's language.",
        "    indented = True",
        "\tTabbed line",
        "trailing spaces   ",
        "trailing tab\t",
        "café au lait",  # NFC
        "cafe\u0301 au lait",  # the same text, not NFC
        "使用中文回答。",
        "```python",
        "def findKth(nums1, nums2, k):",
        "    return findKth(nums1[i:], nums2, j) ",
        "```",
        "- a list item",
        "",
        "   ",
    ]
)
VOLATILE_LINES = st.sampled_from(
    [
        "Current time: 2026-11-29T14:03:11Z",
        "Today is Sunday, 02:03:11 PM",
        "当前时间：2026年11月29日 14:03",
        "Request 550e8400-e29b-41d4-a716-446655440000",
        "<context>\nFirst paragraph.\n\nSecond paragraph.\n\n    def f():\n        return 1  \n</context>",
        "<context>\n</context>",
    ]
)


@st.composite
def text(draw: Any, volatile: bool) -> str:
    lines = draw(st.lists(PLAIN_LINES, min_size=1, max_size=8))
    if volatile:
        for _ in range(draw(st.integers(1, 3))):
            where = draw(st.sampled_from(["top", "middle", "end"]))
            at = {"top": 0, "middle": len(lines) // 2, "end": len(lines)}[where]
            lines.insert(at, draw(VOLATILE_LINES))
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    return newline.join(line.replace("\n", newline) for line in lines)


@st.composite
def content(draw: Any, volatile: bool) -> str | list[dict[str, Any]]:
    value = draw(text(volatile))
    if draw(st.booleans()):
        return value
    cut = draw(st.integers(0, len(value)))
    return [{"type": "text", "text": part} for part in (value[:cut], value[cut:]) if part] or value


@st.composite
def conversation(draw: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": draw(content(volatile=True))}]
    for turn in range(draw(st.integers(1, 4))):
        messages.append({"role": "user", "content": draw(content(volatile=draw(st.booleans())))})
        if draw(st.booleans()):
            call_id = f"call_{turn}"
            call = {"id": call_id, "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": draw(text(volatile=False))})
        messages.append({"role": "assistant", "content": draw(text(volatile=False))})
    messages.append({"role": "user", "content": draw(content(volatile=False))})
    return {"model": "m", "messages": messages}


def texts(message: dict[str, Any]) -> list[str]:
    value = message.get("content")
    if isinstance(value, str):
        return [value]
    return [p["text"] for p in value or [] if isinstance(p, dict) and isinstance(p.get("text"), str)]


def line_counts(messages: list[dict[str, Any]]) -> tuple[Counter[str], int]:
    """Non-empty lines (each with its CR and blanks) and the number of empty ones."""
    lines = [line for message in messages for each in texts(message) for line in each.split("\n")]
    return Counter(line for line in lines if line), sum(1 for line in lines if not line)


def assert_byte_exact(sent: dict[str, Any], forwarded: dict[str, Any]) -> None:
    sent_lines, sent_empty = line_counts(sent["messages"])
    got_lines, got_empty = line_counts(forwarded["messages"])
    # Every client line arrives whole, byte for byte, as often as it was sent: nothing dropped,
    # nothing duplicated, nothing re-formatted; only empty separator lines may be added.
    assert got_lines == sent_lines
    assert got_empty >= sent_empty
    # Every detected span arrives byte-identical.
    forwarded_text = "\x00".join(t for m in forwarded["messages"] for t in texts(m))
    for message in sent["messages"]:
        for each in texts(message):
            for span in detect_spans(each, BUILTIN_DETECTORS.values()):
                assert each[span.start : span.end] in forwarded_text

    # Everything but system messages arrives untouched and in order.
    def others(body: dict[str, Any]) -> list[str]:
        return [json.dumps(m) for m in body["messages"] if m.get("role") != "system"]

    assert others(forwarded) == others(sent)


@settings(max_examples=150, deadline=None)
@given(conversation(), st.sampled_from(["before_last_user", "after_last_user", "system_end"]))
def test_moving_at_first_sight_keeps_every_line_byte_exact(body: dict[str, Any], target: str) -> None:
    """Without memories every detected span moves at once: the hardest case for the bytes."""
    original = json.dumps(body)
    result = canonicalize(body, CanonOptions(mode="relocate", relocate_target=target))  # type: ignore[arg-type]
    assert json.dumps(body) == original, "the input must not be mutated"
    assert_byte_exact(body, result.body)


@settings(max_examples=100, deadline=None)
@given(st.lists(conversation(), min_size=2, max_size=4))
def test_the_default_pipeline_keeps_every_line_byte_exact(bodies: list[dict[str, Any]]) -> None:
    """Several apps' requests through one proxy's memories (spans vary between them, so they move)."""
    canonicalizer = Canonicalizer(CanonSettings())
    for body in bodies:
        assert_byte_exact(body, canonicalizer.apply(body, "tenant").body)


def _turns_of(system: list[dict[str, str]]) -> dict[str, Any]:
    same = [{"type": "text", "text": "You are a helpful assistant."}]
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": same},
            {"role": "assistant", "content": "You are a helpful assistant."},
            {"role": "user", "content": same},
        ],
    }


STAMP = "Current time: 2026-11-29T14:03:11Z"


@settings(max_examples=100, deadline=None)
@given(conversation())
# Found by this test: one line repeated is no environment block; a line split across text parts.
@example(_turns_of([{"type": "text", "text": f"{STAMP}\n{STAMP}\nYou are a helpful assistant."}]))
@example(
    _turns_of(
        [
            {"type": "text", "text": f"You are a helpful assistant.\n{STAMP}\nCurrent time:"},
            {"type": "text", "text": " 2026-11-29T14:03:11Z"},
        ]
    )
)
def test_a_conversation_with_nothing_varying_is_forwarded_as_sent(body: dict[str, Any]) -> None:
    """Replayed twice, turn by turn (history re-sent exactly): every request arrives byte-identical.

    Except an agent's environment block (FIRST_SIGHT_KINDS), which moves behind the tools from a
    conversation's first request on: then every turn is laid out as the first was, so each extends
    the one before, and the replay is forwarded exactly as the first pass was."""
    canonicalizer = Canonicalizer(CanonSettings())
    messages = body["messages"]
    turns = [i + 1 for i, m in enumerate(messages) if m["role"] == "user"]
    systems = [m for m in messages if m["role"] == "system"]
    environment = any(
        detect_spans(text, [BUILTIN_DETECTORS["environment"]])
        for m in systems
        for text in ([m["content"]] if isinstance(m["content"], str) else [p["text"] for p in m["content"]])
    )
    passes: list[list[str]] = []
    for _ in range(2):
        forwarded_turns = []
        for end in turns:
            request = {"model": "m", "messages": messages[:end]}
            forwarded = canonicalizer.apply(request, "tenant")
            forwarded_turns.append(json.dumps(forwarded.body))
            if not environment:
                assert json.dumps(forwarded.body) == json.dumps(request)
                assert forwarded.actions == []
            else:
                # The block moved, and stays where it went: the user turns arrive as sent, in order.
                sent = [json.dumps(m) for m in request["messages"] if m["role"] != "system"]
                got = [json.dumps(m) for m in forwarded.body["messages"] if m["role"] != "system"]
                assert got == sent
        passes.append(forwarded_turns)
        if environment:
            laid_out = [json.loads(turn)["messages"] for turn in forwarded_turns]
            for before, after in itertools.pairwise(laid_out):
                assert after[: len(before)] == before, "a turn must extend the one before"
    assert passes[0] == passes[1]
