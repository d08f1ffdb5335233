"""The chat views of Anthropic Messages and Responses requests, and the way back (no I/O)."""

from __future__ import annotations

import copy
import json
from typing import Any

from proxy.canon.canonicalizer import Canonicalizer
from proxy.config import CanonSettings
from proxy.protocols.anthropic import AnthropicView
from proxy.protocols.responses import ResponsesView
from testbed.fakevllm import anthropic as fake_anthropic
from testbed.fakevllm import openai_responses as fake_responses

TOOLS = [
    {"name": "write_file", "description": "Write", "input_schema": {"type": "object", "properties": {"path": {}}}},
    {
        "name": "bash",
        "description": "Run",
        "input_schema": {"properties": {"cmd": {"type": "string"}}, "type": "object"},
    },
]
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=abc123;"},
    {"type": "text", "text": "You are a coding agent."},
    {
        "type": "text",
        "text": "Be careful.\n\n<env>\nWorking directory: /repo\nToday's date: 2025-06-01\n</env>\n",
        "cache_control": {"type": "ephemeral"},
    },
]


def conversation(date: str = "2025-06-01") -> dict[str, Any]:
    system = copy.deepcopy(SYSTEM)
    system[2]["text"] = system[2]["text"].replace("2025-06-01", date)
    return {
        "model": "m",
        "max_tokens": 64,
        "system": system,
        "tools": copy.deepcopy(TOOLS),
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Fix the bug", "cache_control": {"type": "ephemeral"}}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py\nb.py", "is_error": False},
                    {"type": "text", "text": "go on"},
                ],
            },
        ],
    }


def test_anthropic_view_renders_what_vllm_renders() -> None:
    body = conversation()
    view = AnthropicView.of(body)
    # The view's text is what vLLM's own conversion (mirrored by the fake backend) renders.
    converted = fake_anthropic.to_chat(view.body, merge_inline_system=False)
    roles = [m["role"] for m in view.chat["messages"]]
    assert roles == [m["role"] for m in converted["messages"]] == ["system", "user", "assistant", "tool", "user"]
    system_text = "".join(p["text"] for p in view.chat["messages"][0]["content"])
    assert system_text == converted["messages"][0]["content"]
    assert "billing" not in system_text
    assert view.chat["messages"][2]["tool_calls"][0]["function"]["arguments"] == json.dumps({"cmd": "ls"})
    assert view.chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py\nb.py"}
    assert [t["function"]["name"] for t in view.chat["tools"]] == ["bash", "write_file"]


def test_anthropic_unchanged_view_restores_the_same_objects() -> None:
    body = conversation()
    body["tools"] = sorted(body["tools"], key=lambda t: t["name"])
    body["tools"] = json.loads(json.dumps(body["tools"], sort_keys=True))
    view = AnthropicView.of(body)
    restored = view.restore(view.chat)
    assert restored == body
    assert all(a is b for a, b in zip(restored["messages"], body["messages"], strict=True))
    assert restored["system"] is body["system"]


def test_anthropic_tools_canonicalized_on_the_body() -> None:
    view = AnthropicView.of(conversation())
    restored = view.restore(view.chat)
    assert [t["name"] for t in restored["tools"]] == ["bash", "write_file"]
    assert list(restored["tools"][0]) == ["description", "input_schema", "name"]
    assert view.actions == ["tools_canonicalized:2"]


def test_anthropic_moved_lines_become_an_inline_system_message_byte_exact() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    for date in ("2025-06-01", "2025-06-02"):
        view = AnthropicView.of(conversation(date))
        canon = canonicalizer.apply(view.chat, "t")
        out = view.restore(canon.body)
    assert any(str(a).startswith("volatile_moved") for a in canon.actions)
    # The billing block and cache_control breakpoints stay; the date left the system prompt.
    assert out["system"][0] == SYSTEM[0]
    assert out["system"][1] is view.body["system"][1]
    assert out["system"][2]["cache_control"] == {"type": "ephemeral"}
    assert "2025-06-02" not in out["system"][2]["text"]
    inserted = [m for m in out["messages"] if m["role"] == "system"]
    # The agent's environment block moves whole, its tags with it.
    env = "<env>\nWorking directory: /repo\nToday's date: 2025-06-02\n</env>\n"
    assert inserted == [{"role": "system", "content": env}]
    assert out["system"][2]["text"].rstrip() == "Be careful."
    # Where vLLM renders it: before the last user message, which is after the tool result of the
    # same client message (vLLM renders tool results first): that message is split around it, its
    # blocks the client's own objects. The messages before are the client's own objects.
    original = view.body["messages"]
    assert out["messages"][0] is original[0] and out["messages"][1] is original[1]
    assert [m["role"] for m in out["messages"][2:]] == ["user", "system", "user"]
    assert out["messages"][2]["content"][0] is original[2]["content"][0]
    assert out["messages"][4]["content"][0] is original[2]["content"][1]
    # Moved, not dropped: every byte the model was told is still sent.
    text = "".join(b["text"] for b in out["system"][1:]) + inserted[0]["content"]
    assert sorted(text.replace("\n", "")) == sorted(
        "".join(b["text"] for b in conversation("2025-06-02")["system"][1:]).replace("\n", "")
    )


def test_anthropic_restored_tool_ids_reach_blocks_and_results() -> None:
    view = AnthropicView.of(conversation())
    chat = copy.deepcopy(view.chat)
    chat["messages"][2]["tool_calls"][0]["id"] = "call_original"
    chat["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"cmd":"ls"}'
    chat["messages"][3]["tool_call_id"] = "call_original"
    out = view.restore(chat)
    tool_use = out["messages"][1]["content"][1]
    assert tool_use == {"type": "tool_use", "id": "call_original", "name": "bash", "input": {"cmd": "ls"}}
    result = out["messages"][2]["content"]
    assert result[0] == {
        "type": "tool_result",
        "tool_use_id": "call_original",
        "content": "a.py\nb.py",
        "is_error": False,
    }
    assert result[1] is view.body["messages"][2]["content"][1]


def test_anthropic_summary_folds_whole_messages() -> None:
    view = AnthropicView.of(conversation())
    summary = {"role": "system", "content": "Summary of the earlier part of this conversation:\nfixed"}
    forwarded = [view.chat["messages"][0], summary, view.chat["messages"][4]]
    system, messages = view.restore_messages(forwarded)
    assert system is view.body["system"]
    assert messages[0] == summary
    # Only the text block of the last message stays: its tool result went into the summary.
    assert messages[1] == {"role": "user", "content": [{"type": "text", "text": "go on"}]}


def responses_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "instructions": "You are an agent.\nCurrent time: 2025-06-01T10:00:00Z",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "List the files"}]},
            {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": '{"dir": "."}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [{"type": "function", "name": "ls", "parameters": {"type": "object", "properties": {}}}],
        **extra,
    }


def test_responses_view_renders_what_vllm_renders() -> None:
    view = ResponsesView.of(responses_body())
    vllm = fake_responses.input_messages(view.body, None)
    assert [m["role"] for m in view.chat["messages"]] == [m["role"] for m in vllm]
    assert view.chat["messages"][2]["tool_calls"][0]["id"] == "call_1"
    assert view.chat["messages"][3] == {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}


def test_responses_unchanged_and_moved() -> None:
    body = responses_body()
    view = ResponsesView.of(body)
    assert view.restore(view.chat) == {**body, "tools": view.body["tools"]}
    canonicalizer = Canonicalizer(CanonSettings())
    for time in ("10:00:00", "10:05:00"):
        body = responses_body(instructions=f"You are an agent.\nCurrent time: 2025-06-01T{time}Z")
        view = ResponsesView.of(body)
        out = view.restore(canonicalizer.apply(view.chat, "t").body)
    assert out["instructions"] == "You are an agent."
    assert {"role": "system", "content": "Current time: 2025-06-01T10:05:00Z"} in out["input"]
    assert out["input"][:4] == body["input"][:4]


def test_responses_string_input_stays_a_string() -> None:
    body = {"model": "m", "input": "hello", "instructions": "Be brief."}
    view = ResponsesView.of(body)
    assert view.restore(view.chat)["input"] == "hello"


def test_responses_chain_keeps_instructions_out_of_the_view() -> None:
    view = ResponsesView.of(responses_body(previous_response_id="resp_1"))
    assert view.chat["messages"][0]["role"] == "user"
    assert view.restore(view.chat)["instructions"] == responses_body()["instructions"]


def test_tool_views_are_made_once_per_tenant_and_list_and_equal_a_fresh_view() -> None:
    from proxy.protocols.base import tool_views

    made: list[Any] = []

    def view(tool: Any) -> Any:
        made.append(tool)
        return {"type": "function", "function": {"name": tool["name"]}}

    tools = [{"name": "Read", "input_schema": {"type": "object"}}, {"name": "Edit", "input_schema": {}}]
    first = tool_views(tools, view, "tenant-a")
    again = tool_views([dict(t) for t in tools], view, "tenant-a")  # the next request: a fresh parse
    assert first == again == [view(t) for t in tools]
    assert first is not again  # a list of the request's own
    made.clear()
    tool_views(tools, view, "tenant-a")
    assert made == []
    tool_views(tools, view, "tenant-b")  # another tenant's request is not faster for tenant-a's
    assert len(made) == 2


def test_tool_views_of_a_list_orjson_writes_ambiguously_are_made_afresh() -> None:
    from proxy.protocols.base import tool_views

    def view(tool: Any) -> Any:
        return {"function": {"default": tool["default"]}}

    nan = [{"name": "f", "default": float("nan")}]
    none = [{"name": "f", "default": None}]
    assert tool_views(none, view, "t")[0]["function"]["default"] is None
    views = tool_views(nan, view, "t")  # both serialize as null: never the other's view
    assert views[0]["function"]["default"] != views[0]["function"]["default"]  # NaN


def _anthropic_conversation(turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}"})
        content: list[dict[str, Any]] = [
            {"type": "text", "text": f"answer {turn}"},
            {"type": "tool_use", "id": f"toolu_{turn}", "name": "look", "input": {"n": turn, "ok": True}},
        ]
        messages.append({"role": "assistant", "content": content})
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": "1"}]}
        )
    messages.append({"role": "user", "content": "and now?"})
    return {"model": "m", "max_tokens": 64, "system": "It is 10:00. Be brief.", "messages": messages}


def test_a_conversations_history_is_viewed_once(monkeypatch: Any) -> None:
    """The next request of a Messages conversation, its history the very objects viewed last time (a
    long body comes back so from the resumed parse), views only the messages it adds, and its view is
    the one a fresh view makes; a history equal but not the same objects is viewed again."""
    import proxy.protocols.anthropic as anthropic

    viewed: list[Any] = []
    original = anthropic._message_view

    def counted(message: dict[str, Any]) -> Any:
        viewed.append(message)
        return original(message)

    monkeypatch.setattr(anthropic, "_message_view", counted)
    first = _anthropic_conversation(6)
    AnthropicView.of(first, namespace="views-once")
    second = {
        **first,
        "system": "It is 10:01. Be brief.",
        "messages": [*first["messages"], {"role": "user", "content": "more?"}],
    }
    viewed.clear()
    resumed = AnthropicView.of(second, namespace="views-once")
    assert viewed == [second["messages"][-1]]
    fresh = AnthropicView.of(copy.deepcopy(second), namespace="views-fresh")
    assert resumed.chat["messages"] == fresh.chat["messages"] and resumed.sources == fresh.sources
    assert [resumed.viewed_as(k) for k in range(len(second["messages"]))] == [
        fresh.viewed_as(k) for k in range(len(second["messages"]))
    ]
    # Restored as the client sent it, its own objects.
    _, restored = resumed.restore_messages(resumed.chat["messages"])
    assert all(a is b for a, b in zip(restored, second["messages"], strict=True))
    # Equal, not the same: true became 1 in a copy; nothing viewed from the other objects is taken.
    third = copy.deepcopy(second)
    third["messages"][1]["content"][1]["input"]["ok"] = 1
    viewed.clear()
    view = AnthropicView.of(third, namespace="views-once")
    assert len(viewed) == len(third["messages"])
    assert json.dumps(view.chat["messages"]) == json.dumps(
        AnthropicView.of(copy.deepcopy(third), namespace="x").chat["messages"]
    )


def test_a_responses_input_is_viewed_once_and_a_call_joins_the_message_before_it(monkeypatch: Any) -> None:
    """The next request of a Responses conversation (``store`` false: its whole input again), its items
    the very objects viewed last time, views only from the last message they made (a function call
    that follows an assistant message joins it): its view is the one a fresh view makes."""
    import proxy.protocols.responses as responses

    viewed: list[Any] = []
    original = responses._add_item

    def counted(item: Any, *rest: Any) -> None:
        viewed.append(item)
        original(item, *rest)

    monkeypatch.setattr(responses, "_add_item", counted)
    items: list[dict[str, Any]] = []
    for turn in range(5):
        items.append({"role": "user", "content": f"question {turn}"})
        items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"a{turn}"}]})
    first = {"model": "m", "instructions": "It is 10:00.", "input": items, "store": False}
    ResponsesView.of(first, namespace="responses-once")
    call = {"type": "function_call", "call_id": "c1", "name": "look", "arguments": '{"ok": true}'}
    output = {"type": "function_call_output", "call_id": "c1", "output": "1"}
    second = {**first, "instructions": "It is 10:01.", "input": [*items, call, output]}
    viewed.clear()
    resumed = ResponsesView.of(second, namespace="responses-once")
    assert viewed == [items[-1], call, output]  # the last assistant message again, then what is new
    fresh = ResponsesView.of(copy.deepcopy(second), namespace="responses-fresh")
    assert resumed.chat["messages"] == fresh.chat["messages"] and resumed.sources == fresh.sources
    assert resumed.chat["messages"][-2]["tool_calls"][0]["id"] == "c1"  # joined the assistant message
    _, restored = resumed.restore_input(resumed.chat["messages"])
    assert all(a is b for a, b in zip(restored, second["input"], strict=True))
    # The first request's view is untouched by the second's (the call joined a new message).
    again = ResponsesView.of(first, namespace="responses-once")
    assert "tool_calls" not in again.chat["messages"][-1]


def test_the_unchanged_lead_is_restored_as_the_whole_alignment_restores_it() -> None:
    """The client messages that lead the forwarded list unchanged (after a system prompt that alone
    changed) are taken at once; what that gives is what aligning every message gives."""
    import random

    for seed in range(60):
        rng = random.Random(seed)
        body = _anthropic_conversation(rng.randint(1, 12))
        view = AnthropicView.of(body, namespace=f"lead-{seed}")
        forwarded = list(view.chat["messages"])
        if rng.random() < 0.7:  # the clock moved out of the system prompt
            forwarded[0] = {"role": "system", "content": "Be brief."}
        if rng.random() < 0.7:  # ... and into a block before the last user turn
            forwarded.insert(len(forwarded) - 1, {"role": "system", "content": "It is 10:00."})
        if rng.random() < 0.3 and len(forwarded) > 4:  # a rewritten message in the middle
            at = rng.randint(1, len(forwarded) - 2)
            forwarded[at] = {**forwarded[at], "content": str(forwarded[at].get("content")) + "!"}
        fast = view.restore_messages(forwarded)
        slow_view = AnthropicView(view.body, view.chat, view.sources, view.actions)  # no ends: every message aligned
        assert json.dumps(fast, default=repr) == json.dumps(slow_view.restore_messages(forwarded), default=repr), seed


def test_the_unchanged_lead_of_a_responses_input_is_restored_as_the_whole_alignment_restores_it() -> None:
    """Items whose view messages lead the forwarded list unchanged (after instructions that alone
    changed) are taken at once, up to the first message not made of the next items in order (an
    item the view leaves out, a call joining its message across one); what that gives is what
    aligning every message gives."""
    import random

    for seed in range(60):
        rng = random.Random(seed)
        items: list[dict[str, Any]] = []
        for turn in range(rng.randint(1, 10)):
            items.append({"role": "user", "content": f"question {turn}"})
            text = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"a{turn}"}]}
            items.append(text)
            if rng.random() < 0.3:
                items.append({"type": "item_reference", "id": f"ref{turn}"})  # left out of the view
            if rng.random() < 0.5:
                items.append({"type": "function_call", "call_id": f"c{turn}", "name": "look", "arguments": "{}"})
                items.append({"type": "function_call_output", "call_id": f"c{turn}", "output": "1"})
        items.append({"role": "user", "content": "and now?"})
        body = {"model": "m", "instructions": "It is 10:00. Be brief.", "input": items, "store": False}
        view = ResponsesView.of(body, namespace=f"responses-lead-{seed}")
        forwarded = list(view.chat["messages"])
        if rng.random() < 0.7:
            forwarded[0] = {"role": "system", "content": "Be brief."}
        if rng.random() < 0.7:
            forwarded.insert(len(forwarded) - 1, {"role": "system", "content": "It is 10:00."})
        fast = view.restore_input(forwarded)
        slow_view = ResponsesView(view.body, view.chat, view.sources, view.actions)  # covered unknown
        assert json.dumps(fast, default=repr) == json.dumps(slow_view.restore_input(forwarded), default=repr), seed
