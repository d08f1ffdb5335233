"""Canonicalization behaviour: relocation, tools, learned volatility, tool-call restoration."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from proxy.canon import (
    CanonOptions,
    LearnedVolatility,
    ToolCallMemory,
    canonicalize,
    remember_generated_calls,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
RELOCATE = CanonOptions()


def system_of(body: dict[str, Any]) -> str:
    return body["messages"][0]["content"]


def test_context_block_moves_before_last_user_turn() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "<context>\nchunk\n</context>\nYou answer from the context."},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
        ],
    }
    result = canonicalize(body, RELOCATE).body
    assert [m["role"] for m in result["messages"]] == ["system", "user", "assistant", "system", "user"]
    assert system_of(result) == "You answer from the context."
    assert result["messages"][3]["content"] == "<context>\nchunk\n</context>"


def test_system_end_target_keeps_one_system_message() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Now: 2026-11-29 14:03\nBe brief."},
            {"role": "user", "content": "hi"},
        ],
    }
    result = canonicalize(body, CanonOptions(relocate_target="system_end")).body
    assert system_of(result) == "Be brief.\n\nNow: 2026-11-29 14:03"
    assert len(result["messages"]) == 2


def test_system_prompt_sent_as_text_parts_is_relocated_too() -> None:
    """OpenAI's API takes a system prompt as a list of text parts; some clients send it that way."""

    def body(stamp: str) -> dict[str, Any]:
        parts = [
            {"type": "text", "text": f"You are a support agent.\nCurrent time: 2026-11-29 {stamp}"},
            {"type": "text", "text": "Answer in English."},
        ]
        return {
            "model": "m",
            "messages": [
                {"role": "system", "content": parts},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"},
            ],
        }

    first, second = canonicalize(body("14:03:11"), RELOCATE), canonicalize(body("14:05:40"), RELOCATE)
    assert first.prefix_hash == second.prefix_hash
    assert first.body["messages"][0]["content"] == [
        {"type": "text", "text": "You are a support agent."},
        {"type": "text", "text": "Answer in English."},
    ]
    assert first.body["messages"][3] == {"role": "system", "content": "Current time: 2026-11-29 14:03:11"}
    at_end = canonicalize(body("14:03:11"), CanonOptions(relocate_target="system_end")).body["messages"][0]
    assert at_end["content"][-1] == {"type": "text", "text": "Current time: 2026-11-29 14:03:11"}
    # Anything but text parts (an image, say) is left as sent.
    with_image = body("14:03:11")
    with_image["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "data:,"}})
    assert canonicalize(with_image, RELOCATE).body == with_image


def test_safe_mode_never_moves_text() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Now: 2026-11-29 14:03\nBe brief."},
            {"role": "user", "content": "hi"},
        ],
    }
    assert canonicalize(body, CanonOptions(mode="safe")).body["messages"] == body["messages"]


def test_two_orders_of_tools_give_one_prefix() -> None:
    a = {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {}}}}
    b = {"function": {"parameters": {"properties": {}, "type": "object"}, "name": "b"}, "type": "function"}
    first = canonicalize({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [a, b]}, RELOCATE)
    second = canonicalize({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [b, a]}, RELOCATE)
    assert json.dumps(first.body) == json.dumps(second.body)
    assert first.prefix_hash == second.prefix_hash


def test_timestamp_no_longer_changes_prefix_hash() -> None:
    def request(stamp: str) -> dict[str, Any]:
        return {
            "model": "m",
            "messages": [
                {"role": "system", "content": f"Current time: {stamp}\nBe brief."},
                {"role": "user", "content": "hi"},
            ],
        }

    first = canonicalize(request("2026-11-29 14:03:11"), RELOCATE)
    second = canonicalize(request("2026-11-29 14:05:42"), RELOCATE)
    assert first.prefix_hash == second.prefix_hash


def _dify_prompts_with_inline_query() -> list[str]:
    path = DATA / "dify_prompts.jsonl"
    if not path.exists():
        # The package bundles a subset of the same real prompts (testbed/workload/data).
        path = Path(__file__).resolve().parents[1] / "testbed" / "workload" / "data" / "dify_prompts.jsonl"
    prompts = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for message in record["messages"]:
            if message["role"] == "system" and "{{#sys.query#}}" in message["text"]:
                prompts.append(message["text"])
    return prompts


def test_learned_volatility_moves_an_inlined_query() -> None:
    templates = _dify_prompts_with_inline_query()
    assert templates, "the data set has system prompts that inline the user's question"
    learned = LearnedVolatility()
    queries = [
        "如何申请退款？",
        "What is the refund policy for damaged goods?",
        "订单什么时候发货",
        "Can I change my address?",
    ]
    for template in templates:
        hashes = []
        for query in queries:
            body = {
                "model": "m",
                "messages": [
                    {"role": "system", "content": template.replace("{{#sys.query#}}", query)},
                    {"role": "user", "content": query},
                ],
            }
            result = canonicalize(body, RELOCATE, namespace="t", learned=learned)
            moved = [m["content"] for m in result.body["messages"][1:] if m["role"] == "system"]
            hashes.append(result.prefix_hash)
            if len(hashes) > 1 and "\n" in template:  # a one-line prompt has no stable part to protect
                assert query in "".join(moved), "the query line must move behind the stable part"
                assert query not in system_of(result.body)
        if "\n" in template:
            # From the second request on, the forwarded system prompt no longer changes.
            assert len(set(hashes[1:])) == 1


def test_learned_volatility_is_bounded_and_per_namespace() -> None:
    learned = LearnedVolatility(max_apps=4)
    for app in range(20):
        for variant in range(3):
            body = {
                "model": f"m{app}",
                "messages": [
                    {"role": "system", "content": f"stable\nvar {variant}"},
                    {"role": "user", "content": "x"},
                ],
            }
            canonicalize(body, RELOCATE, namespace="tenant", learned=learned)
    assert len(learned) <= 4


def _dify_agent_history(call_id: str, arguments: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]


def test_generated_tool_calls_restored_byte_for_byte() -> None:
    memory = ToolCallMemory()
    first_request = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "weather in Paris?"},
    ]
    # The backend generated this call; the proxy relayed it and remembers it.
    remember_generated_calls(
        first_request,
        "t",
        [("chatcmpl-tool-abc123", "get_weather", '{"city": "Paris", "unit": "C"}')],
        memory,
    )
    # Dify re-sends it with a fresh uuid4 and re-serialized arguments.
    fresh = str(uuid.uuid4())
    body = {"model": "m", "messages": _dify_agent_history(fresh, '{"unit":"C","city":"Paris"}')}
    result = canonicalize(body, RELOCATE, namespace="t", tool_memory=memory)
    call = result.body["messages"][2]["tool_calls"][0]
    assert call["id"] == "chatcmpl-tool-abc123"
    assert call["function"]["arguments"] == '{"city": "Paris", "unit": "C"}'
    assert result.body["messages"][3]["tool_call_id"] == "chatcmpl-tool-abc123"
    assert "tool_call_ids_restored:1" in [str(a) for a in result.actions]


def test_arguments_are_restored_only_where_the_engine_renders_them_otherwise() -> None:
    """The engine parses argument strings before the template renders them (keys in their order):
    spacing and escapes reach no prompt, key order does."""
    generated = '{"city": "Zürich", "unit": "C"}'
    for sent, restored in (
        ('{"city":"Z\\u00fcrich","unit":"C"}', False),  # spacing and an escape: rendered alike
        ('{"unit": "C", "city": "Zürich"}', True),  # another key order: rendered otherwise
    ):
        memory = ToolCallMemory()
        prior = [{"role": "user", "content": "weather in Paris?"}]
        remember_generated_calls(prior, "t", [("call-1", "get_weather", generated)], memory)
        body = {"model": "m", "messages": _dify_agent_history(str(uuid.uuid4()), sent)}
        result = canonicalize(body, RELOCATE, namespace="t", tool_memory=memory)
        call = result.body["messages"][2]["tool_calls"][0]
        assert call["id"] == "call-1"
        assert call["function"]["arguments"] == (generated if restored else sent), sent
        assert ("tool_call_arguments_restored:1" in [str(a) for a in result.actions]) is restored


def test_unknown_tool_calls_keep_the_first_bytes_forwarded() -> None:
    memory = ToolCallMemory()
    first_id = str(uuid.uuid4())
    first = canonicalize(
        {"model": "m", "messages": _dify_agent_history(first_id, '{"city":"Paris"}')},
        RELOCATE,
        namespace="t",
        tool_memory=memory,
    )
    # A call the proxy never relayed goes out exactly as the client sent it...
    assert first.body["messages"][2]["tool_calls"][0]["id"] == first_id
    assert first.actions == []
    # ...and a re-send with a fresh id and re-dumped arguments gets those bytes back.
    second = canonicalize(
        {"model": "m", "messages": _dify_agent_history(str(uuid.uuid4()), '{"city": "Paris"}')},
        RELOCATE,
        namespace="t",
        tool_memory=memory,
    )
    # (the arguments differ only in spacing, which the engine does not render: kept as sent)
    assert json.dumps(first.body) == json.dumps(second.body).replace('{\\"city\\": ', '{\\"city\\":')
    assert second.body["messages"][2]["tool_calls"][0]["id"] == first_id
    # Without a memory nothing is rewritten.
    alone = canonicalize({"model": "m", "messages": _dify_agent_history("mine", "{}")}, RELOCATE, namespace="t")
    assert alone.body["messages"][2]["tool_calls"][0]["id"] == "mine"


def test_tool_call_memory_is_tenant_scoped() -> None:
    memory = ToolCallMemory()
    prior = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "weather in Paris?"},
    ]
    remember_generated_calls(prior, "tenant-a", [("secret-id", "get_weather", '{"city":"Paris"}')], memory)
    body = {"model": "m", "messages": _dify_agent_history("x", '{"city":"Paris"}')}
    result = canonicalize(body, RELOCATE, namespace="tenant-b", tool_memory=memory)
    assert result.body["messages"][2]["tool_calls"][0]["id"] != "secret-id"


def test_a_template_in_use_outlives_templates_made_after_it() -> None:
    """Many apps share an app key (one tenant's chat apps on one model): the one still sending keeps its
    learned lines while others come and go (templates leave least recently matched first)."""
    learned = LearnedVolatility(templates_per_app=4)
    busy = [f"busy line {n}" for n in range(6)]
    assert learned.observe("key", [*busy, "question 0"]) == set()
    for n in range(1, 12):
        learned.observe("key", [f"other app {n} line {k}" for k in range(6)])  # a new template each time
        assert learned.observe("key", [*busy, f"question {n}"]) == {6}, n


def _agent_requests(turns: int, memory: ToolCallMemory) -> list[list[dict[str, Any]]]:
    """A growing agent conversation whose client re-sends the backend's calls with ids of its own
    (fresh on each request), the same call asked again and again (its key's base repeats), and one
    id the client gives twice; the backend generated every call (``memory`` remembers them)."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
    requests = []
    for turn in range(turns):
        history.append({"role": "user", "content": "weather in Paris?" if turn % 3 else f"turn {turn}"})
        generated = [(f"chatcmpl-tool-{turn}-{n}", "get_weather", '{"city": "Paris"}') for n in range(2)]
        remember_generated_calls(history, "t", generated, memory)
        history.append({"role": "assistant", "content": None, "tool_calls": [{}, {}]})
        history.append({"role": "tool", "tool_call_id": "", "content": "sunny"})
        history.append({"role": "assistant", "content": "Sunny."})
        requests.append(json.loads(json.dumps(history)))
    for number, request in enumerate(requests):
        at = 0
        for message in request:
            if message.get("tool_calls"):
                ids = [f"mine-{number}-{at}", f"mine-{number}-{at}" if at % 4 == 2 else f"other-{number}-{at}"]
                message["tool_calls"] = [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                    for call_id in ids
                ]
                at += 1
            elif message.get("role") == "tool":
                message["tool_call_id"] = f"mine-{number}-{at - 1}"
    return requests


def test_restored_calls_are_the_same_whether_earlier_calls_are_scanned_or_counted(monkeypatch: Any) -> None:
    """A request that adds a few messages looks up its earlier calls' keys and ids with a scan each
    (``_EarlierCalls``), one that adds many counts them all at once: both restore the same."""
    from proxy.canon import toolcalls

    forwarded: dict[int, list[str]] = {}
    for scanned_max in (0, 1 << 30):
        monkeypatch.setattr(toolcalls._EarlierCalls, "SCANNED_MAX", scanned_max)
        memory = ToolCallMemory()
        for requests in (_agent_requests(12, memory),):
            out = []
            for request in requests:
                result = canonicalize({"model": "m", "messages": request}, RELOCATE, namespace="t", tool_memory=memory)
                out.append(json.dumps(result.body) + json.dumps([str(a) for a in result.actions]))
            forwarded[scanned_max] = out
    assert forwarded[0] == forwarded[1 << 30]
    assert "chatcmpl-tool-" in forwarded[0][-1]


def test_a_generated_call_is_found_by_its_id_only_to_restore_its_own_arguments() -> None:
    """A client keeps the backend's id: its arguments may come back in another key order (restored),
    never with other values, and never in another tenant (an id is the client's to choose)."""
    memory = ToolCallMemory()
    prior = [{"role": "user", "content": "weather in Paris?"}]
    generated = '{"city": "Paris", "unit": "C"}'
    remember_generated_calls(prior, "t", [("chatcmpl-tool-1", "get_weather", generated)], memory)

    def sent(namespace: str, arguments: str) -> dict[str, Any]:
        # Another user message: the position key does not find the call, only its id can.
        history = _dify_agent_history("chatcmpl-tool-1", arguments)
        history[1] = {"role": "user", "content": "and now?"}
        result = canonicalize({"model": "m", "messages": history}, RELOCATE, namespace=namespace, tool_memory=memory)
        call: dict[str, Any] = result.body["messages"][2]["tool_calls"][0]
        return call

    assert sent("t", '{"unit": "C", "city": "Paris"}')["function"]["arguments"] == generated
    assert sent("t", '{"city": "Rome", "unit": "C"}')["function"]["arguments"] == '{"city": "Rome", "unit": "C"}'
    assert sent("other", '{"unit": "C", "city": "Paris"}')["function"]["arguments"] == '{"unit": "C", "city": "Paris"}'
