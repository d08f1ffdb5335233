"""Property tests: canonicalization is idempotent, lossless, and leaves canonical requests alone."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.canon import CanonOptions, canonicalize
from proxy.openai.jsoncanon import sort_keys_deep

WORDS = st.sampled_from(
    [
        "You",
        "are",
        "a",
        "helpful",
        "assistant",
        "answer",
        "briefly",
        "使用",
        "中文",
        "回答",
        "tools",
        "Ünïcode",
        "é",
    ]
)
STABLE_LINE = st.lists(WORDS, min_size=1, max_size=8).map(" ".join)
VOLATILE_LINE = st.sampled_from(
    [
        "Current time: 2026-11-29T14:03:11Z",
        "当前时间：2026年11月29日 14:03",
        "Today is Sunday, 02:03:11 PM",
        "session 550e8400-e29b-41d4-a716-446655440000",
        "<context>\nretrieved chunk about billing\nsecond chunk\n</context>",
    ]
)
LINE = st.one_of(STABLE_LINE, STABLE_LINE.map(lambda s: s + "  "), VOLATILE_LINE, st.just(""))


@st.composite
def tool(draw: Any) -> dict[str, Any]:
    name = draw(st.sampled_from(["search", "get_weather", "book", "cancel", "lookup"]))
    props = {p: {"type": "string", "description": f"{p} value"} for p in draw(st.sets(st.sampled_from("abcdef")))}
    parameters = {"type": "object", "properties": props, "required": sorted(props)[:1]}
    function = {"name": name, "description": f"{name} tool", "parameters": parameters}
    items = list({"type": "function", "function": function}.items())
    random.Random(draw(st.integers(0, 1000))).shuffle(items)
    return dict(items)


@st.composite
def chat_request(draw: Any) -> dict[str, Any]:
    lines = draw(st.lists(LINE, min_size=1, max_size=8))
    system: str | list[dict[str, Any]] = "\n".join(lines)
    if draw(st.booleans()):  # the same lines as text parts, as some clients send system prompts
        cut = draw(st.integers(0, len(lines)))
        chunks = [chunk for chunk in (lines[:cut], lines[cut:]) if chunk]
        system = [{"type": "text", "text": "\n".join(chunk)} for chunk in chunks]
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(STABLE_LINE) + draw(st.sampled_from(["", "\r\n", "  "]))})
        if draw(st.booleans()):
            call_id = f"call_{turn}_{draw(st.integers(0, 9999))}"
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "search", "arguments": '{"q": "x"}'},
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": "result " + draw(STABLE_LINE)})
        messages.append({"role": "assistant", "content": draw(STABLE_LINE) + "  "})
    messages.append({"role": "user", "content": draw(STABLE_LINE)})
    body: dict[str, Any] = {"model": "m", "messages": messages}
    tools = draw(st.lists(tool(), max_size=5, unique_by=lambda t: t["function"]["name"]))
    if tools:
        body["tools"] = tools
    return body


OPTIONS = [
    CanonOptions(mode="safe"),
    CanonOptions(mode="relocate"),
    CanonOptions(mode="relocate", relocate_target="system_end"),
]


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def all_text(body: dict[str, Any]) -> str:
    return dumps(body["messages"])


@settings(max_examples=200, deadline=None)
@given(chat_request(), st.sampled_from(OPTIONS))
def test_idempotent(body: dict[str, Any], options: CanonOptions) -> None:
    once = canonicalize(body, options).body
    twice = canonicalize(once, options)
    assert dumps(twice.body) == dumps(once)
    assert twice.actions == []


@settings(max_examples=200, deadline=None)
@given(chat_request(), st.sampled_from(OPTIONS))
def test_content_preserved(body: dict[str, Any], options: CanonOptions) -> None:
    original = json.loads(dumps(body))
    result = canonicalize(body, options).body
    assert body == original, "the input must not be mutated"
    text = all_text(result)
    for message in body["messages"]:
        content = message.get("content")
        texts = [content] if isinstance(content, str) else [p["text"] for p in content or [] if "text" in p]
        for each in texts:
            for line in each.replace("\r\n", "\n").split("\n"):
                assert dumps(line.rstrip())[1:-1] in text
    canonical_tools = [sort_keys_deep(t) for t in body.get("tools", [])]
    assert sorted(map(dumps, canonical_tools)) == sorted(map(dumps, result.get("tools", [])))
    # Assistant output is never re-formatted: every assistant text survives byte for byte.
    sent = [m.get("content") for m in body["messages"] if m["role"] == "assistant"]
    got = [m.get("content") for m in result["messages"] if m["role"] == "assistant"]
    assert sent == got
    # Tool results keep pointing at their calls.
    ids = {c["id"] for m in result["messages"] for c in m.get("tool_calls") or []}
    assert all(m["tool_call_id"] in ids for m in result["messages"] if m["role"] == "tool")


@settings(max_examples=100, deadline=None)
@given(chat_request(), st.sampled_from(OPTIONS))
def test_canonical_requests_pass_byte_identical(body: dict[str, Any], options: CanonOptions) -> None:
    canonical = canonicalize(body, options).body
    raw = dumps(canonical)
    again = canonicalize(json.loads(raw), options)
    assert dumps(again.body) == raw


def test_off_mode_is_identity() -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "Time: 2026-11-29 14:03  "}]}
    result = canonicalize(body, CanonOptions(mode="off"))
    assert result.body is body
    assert result.actions == []
