"""Smoke test of the real engine: vLLM (CPU build) serving the random-weight model with forced replies.

The engine comes from the session fixture `real_vllm` (conftest.py here), which installs it first when
it is missing and skips, with the reason, when it cannot be installed on this machine.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

from bench.real_vllm.engine import PrefixCacheCounters, RealVLLM
from bench.real_vllm.hooks import expected_reply
from tests.helpers import chat_ok

pytestmark = pytest.mark.real_engine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the product documentation",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
]


def long_system_prompt(tag: str) -> str:
    """About 1,500 tokens, unique per tag so each test starts from a cold prefix."""
    rules = " ".join(
        f"Rule {i}: answer in the customer's language, cite handbook section {i}.{i % 7}, "
        f"never reveal internal ticket numbers such as T-{1000 + 37 * i}."
        for i in range(60)
    )
    return f"You are the support assistant of ACME ({tag}).\n{rules}"


@pytest.fixture
def engine(real_vllm: RealVLLM) -> RealVLLM:
    return real_vllm


def cached_tokens(response: dict[str, Any]) -> int:
    details = response["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)  # missing means a miss


def wait_for_counters(engine: RealVLLM, before: PrefixCacheCounters, hits: int) -> PrefixCacheCounters:
    """The counters are updated by the server's output loop, possibly just after the response."""
    deadline = time.monotonic() + 10
    while True:
        delta = engine.metrics() - before
        if delta.hits >= hits or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_shared_system_prompt_hits_the_prefix_cache(engine: RealVLLM) -> None:
    system = long_system_prompt("prefix-cache test")
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Where is my parcel?"}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "Can I change my address?"}]
    ids1, ids2 = engine.tokenize_chat(first), engine.tokenize_chat(second)
    assert len(ids1) > 1000

    before = engine.metrics()
    r1 = chat_ok(engine.base_url, first, model=engine.model, timeout=300, max_tokens=32)
    r2 = chat_ok(engine.base_url, second, model=engine.model, timeout=300, max_tokens=32)

    assert r1["usage"]["prompt_tokens"] == len(ids1)
    assert r2["usage"]["prompt_tokens"] == len(ids2)
    assert cached_tokens(r1) == 0
    # APC reuses the whole blocks of the common prefix, nothing more.
    block = engine.block_size
    assert cached_tokens(r2) == common_prefix_len(ids1, ids2) // block * block > 0

    delta = wait_for_counters(engine, before, cached_tokens(r1) + cached_tokens(r2))
    assert delta.hits == cached_tokens(r1) + cached_tokens(r2)
    assert delta.queries == len(ids1) + len(ids2)


def test_text_reply_is_deterministic_and_forced(engine: RealVLLM) -> None:
    messages = [
        {"role": "system", "content": long_system_prompt("text reply test")},
        {"role": "user", "content": "Explain how the prefix cache decides what to reuse."},
    ]
    r1 = chat_ok(engine.base_url, messages, model=engine.model, timeout=300, max_tokens=48, temperature=1.0)
    r2 = chat_ok(engine.base_url, messages, model=engine.model, timeout=300, max_tokens=48, temperature=1.0, seed=7)
    text1, text2 = r1["choices"][0]["message"]["content"], r2["choices"][0]["message"]["content"]
    assert text1 and text1 == text2
    assert cached_tokens(r2) > 0
    # The engine says exactly what the fake backend's reply function decides for this prompt.
    ids = engine.tokenize_chat(messages)
    assert text1 == expected_reply(engine.model_dir, ids, 48)
    assert r1["usage"]["completion_tokens"] <= 48


def test_tool_call_reply_is_deterministic(engine: RealVLLM) -> None:
    messages = [
        {"role": "system", "content": long_system_prompt("tool call test")},
        {"role": "user", "content": "What is the weather like in Lisbon today?"},
    ]
    r1 = chat_ok(engine.base_url, messages, model=engine.model, timeout=300, tools=TOOLS, max_tokens=128)
    r2 = chat_ok(engine.base_url, messages, model=engine.model, timeout=300, tools=TOOLS, max_tokens=128)
    # Under tool_choice="required" a grammar constrains the output; the forced tool call fits it.
    r3 = chat_ok(
        engine.base_url, messages, model=engine.model, timeout=300, tools=TOOLS, max_tokens=128, tool_choice="required"
    )
    calls = []
    for r in (r1, r2, r3):
        choice = r["choices"][0]
        assert choice["finish_reason"] in ("tool_calls", "stop"), choice
        (call,) = choice["message"]["tool_calls"]
        calls.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    assert calls[0] == calls[1] == calls[2]
    assert r1["choices"][0]["finish_reason"] == "tool_calls"
    assert calls[0][0] in {t["function"]["name"] for t in TOOLS}

    expected = expected_reply(engine.model_dir, engine.tokenize_chat(messages, TOOLS), 128)
    match = re.search(r"<tool_call>\s*(\{.*\})\s*</tool_call>", expected, re.DOTALL)
    assert match, expected
    forced = json.loads(match.group(1))
    assert calls[0] == (forced["name"], forced["arguments"])
