"""Tools are canonicalized only where they vary: a client that sends one fixed tool list is
forwarded as sent; one that reorders gets the form first seen, from its first request on."""

from __future__ import annotations

import random
from typing import Any

import orjson

from proxy.canon import canonicalize
from proxy.canon.canonicalizer import Canonicalizer
from proxy.canon.engine import CanonOptions
from proxy.canon.tools import ToolOrders, canonicalize_tool_fields
from proxy.config import CanonSettings
from proxy.protocols.anthropic import AnthropicView
from testbed.workload.corpus import tool_suite

SYSTEM = "You are a coding agent.\nAnswer in the user's language."


def tools() -> list[dict[str, Any]]:
    # BFCL's real tool definitions, in the order and key order the file gives, shuffled once so
    # that the list is not already in canonical order.
    return shuffled(tool_suite("message_api") + tool_suite("ticket_api"), 99)


def request(tool_list: list[dict[str, Any]], question: str = "What does main.py do?") -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "tools": tool_list,
    }


def shuffled(tool_list: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    out = list(tool_list)
    random.Random(seed).shuffle(out)
    return out


def test_a_fixed_tool_list_is_forwarded_as_sent() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    sent = tools()
    assert orjson.dumps(sent) != orjson.dumps(canonicalize(request(sent), CanonOptions()).body["tools"])
    for turn in range(5):
        result = canonicalizer.apply(request(sent, f"question {turn}"), "tenant")
        assert orjson.dumps(result.body["tools"]) == orjson.dumps(sent)
        assert not [a for a in result.actions if a.kind == "tools_canonicalized"]


def test_a_reordering_client_gets_the_first_form_from_its_second_request() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    first = tools()
    forwarded = [canonicalizer.apply(request(shuffled(first, seed) if seed else first), "t") for seed in range(6)]
    for result in forwarded:
        assert orjson.dumps(result.body["tools"]) == orjson.dumps(first)
    assert [a.kind for a in forwarded[1].actions] == ["tools_canonicalized"]


def test_key_order_variation_is_given_back_as_the_first_form() -> None:
    orders = ToolOrders()
    first = tools()
    reordered_keys = [{"function": dict(reversed(list(t["function"].items()))), "type": t["type"]} for t in first]
    body = {"model": "m", "tools": first}
    assert canonicalize_tool_fields(body, orders, "t") == []
    body = {"model": "m", "tools": reordered_keys}
    assert canonicalize_tool_fields(body, orders, "t")
    assert orjson.dumps(body["tools"]) == orjson.dumps(first)


def test_changed_content_and_grown_tool_sets_go_as_sent() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    first = tools()
    canonicalizer.apply(request(first), "t")
    edited = [dict(t) for t in first]
    edited[0] = {"type": "function", "function": {**first[0]["function"], "description": "Edited."}}
    grown = [*first, {"type": "function", "function": {"name": "extra_tool", "parameters": {"type": "object"}}}]
    for changed in (edited, shuffled(grown, 3)):
        result = canonicalizer.apply(request(changed), "t")
        assert orjson.dumps(result.body["tools"]) == orjson.dumps(changed)
    # The edited set is now the reference its reorderings are given back as.
    result = canonicalizer.apply(request(shuffled(edited, 5)), "t")
    assert orjson.dumps(result.body["tools"]) == orjson.dumps(edited)


def test_tenants_and_models_have_their_own_reference() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    first, other = tools(), shuffled(tools(), 7)
    canonicalizer.apply(request(first), "a")
    result = canonicalizer.apply(request(other), "b")
    assert orjson.dumps(result.body["tools"]) == orjson.dumps(other)
    result = canonicalizer.apply({**request(other), "model": "n"}, "a")
    assert orjson.dumps(result.body["tools"]) == orjson.dumps(other)


def test_without_a_memory_tools_are_canonical() -> None:
    result = canonicalize(request(tools()), CanonOptions())
    names = [t["function"]["name"] for t in result.body["tools"]]
    assert names == sorted(names)
    assert canonicalize(result.body, CanonOptions()).body == result.body


def test_anthropic_tools_follow_the_same_rule() -> None:
    orders = ToolOrders()
    anthropic_tools = [
        {"name": f["name"], "description": f.get("description", ""), "input_schema": f["parameters"]}
        for f in (t["function"] for t in tools())
    ]
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], "tools": anthropic_tools}
    view = AnthropicView.of(body, orders, "t")
    assert view.actions == [] and view.body["tools"] == anthropic_tools
    view = AnthropicView.of({**body, "tools": shuffled(anthropic_tools, 1)}, orders, "t")
    assert view.body["tools"] == anthropic_tools


def test_the_memory_is_bounded_by_bytes() -> None:
    orders = ToolOrders(max_bytes=64 * 1024)
    for app in range(200):
        canonicalize_tool_fields({"model": f"m{app}", "tools": tools()}, orders, "t")
    assert len(orders) * len(orjson.dumps(tools())) <= 64 * 1024
    assert len(orders) >= 1


def test_replicas_settle_on_one_reference() -> None:
    from proxy.replicas.memories import Journal, SharedCanonicalizer

    journals = [Journal(), Journal()]
    replicas = [SharedCanonicalizer(CanonSettings(), journal) for journal in journals]
    base = tools()
    # Each replica sees the app first in another order, at the same time.
    for number, replica in enumerate(replicas):
        replica.apply(request(shuffled(base, 10 + number)), "t")
    entries = [journal.drain() for journal in journals]
    replicas[0].apply_entries(entries[1])
    replicas[1].apply_entries(entries[0])
    forwarded = [orjson.dumps(r.apply(request(shuffled(base, 42)), "t").body["tools"]) for r in replicas]
    assert forwarded[0] == forwarded[1]
    assert forwarded[0] in (orjson.dumps(shuffled(base, 10)), orjson.dumps(shuffled(base, 11)))
    assert all(not journal.entries for journal in journals), "adopted references are not journaled again"
