"""Cache diagnostics the hosted APIs give agents, answered by the proxy on a self-hosted engine.

Anthropic's ``diagnostics: {previous_message_id}`` and OpenAI's ``prompt_cache_options:
{comparison_response_id}`` (also on chat completions) name an earlier answer; the proxy compares
the prompt it forwards now with the one that answer answered and says what changed first, how
many tokens that cost and where the prompts first differ, in each API's own shape, read here with
the official SDKs' types. Through real HTTP, against the vLLM-faithful fake backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.helpers import LiveServer

SYSTEM = "\n".join(
    [
        "You are the booking assistant of a hotel chain.",
        "Answer briefly; confirm dates, room type and price before you book.",
        "Never charge a card without the guest's explicit consent.",
    ]
    * 6
)
TOOLS_ANTHROPIC: list[Any] = [
    {
        "name": "find_rooms",
        "description": "Rooms free on given dates.",
        "input_schema": {"type": "object", "properties": {"from": {"type": "string"}, "to": {"type": "string"}}},
    }
]
TOOLS_OPENAI: list[Any] = [
    {
        "type": "function",
        "name": "find_rooms",
        "description": "Rooms free on given dates.",
        "parameters": {"type": "object", "properties": {"from": {"type": "string"}, "to": {"type": "string"}}},
    }
]


def forwarded(fake_backend: LiveServer, endpoint: str) -> dict[str, Any]:
    log = httpx.get(fake_backend.url + "/fake/requests").json()
    return dict(next(r for r in reversed(log) if r["endpoint"] == endpoint))


# -- Anthropic Messages ------------------------------------------------------------------------


@pytest.fixture
def claude(proxy: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key="anything", max_retries=0)


def ask_claude(
    client: anthropic.Anthropic,
    messages: list[Any],
    previous: str | None,
    *,
    system: str = SYSTEM,
    tools: list[Any] = TOOLS_ANTHROPIC,
    stream: bool = False,
) -> anthropic.types.Message:
    kwargs: dict[str, Any] = {
        "model": "fake-model",
        "max_tokens": 32,
        "system": system,
        "tools": tools,
        "messages": messages,
        "extra_body": {"diagnostics": {"previous_message_id": previous}},
    }
    if stream:
        with client.messages.stream(**kwargs) as events:
            return events.get_final_message()
    return client.messages.create(**kwargs)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_diagnostics_hit_system_and_tools_changes(
    claude: anthropic.Anthropic, fake_backend: LiveServer, stream: bool
) -> None:
    messages: list[Any] = [{"role": "user", "content": "A double room from May 3 to May 5, please."}]
    first = ask_claude(claude, messages, None, stream=stream)
    assert first.diagnostics is not None and first.diagnostics.cache_miss_reason is None  # nothing to compare
    assert "diagnostics" not in forwarded(fake_backend, "/v1/messages")["body"]  # answered by the proxy

    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "With breakfast."}]
    second = ask_claude(claude, messages, first.id, stream=stream)
    assert second.diagnostics is not None and second.diagnostics.cache_miss_reason is None  # the prefix held

    # Tools first: once a system line is seen to vary, the proxy moves it out of the system prompt
    # (which is then another system prompt than the second request's).
    tools = [{**TOOLS_ANTHROPIC[0], "description": "Rooms free between two dates."}]
    retooled = ask_claude(claude, messages, second.id, tools=tools, stream=stream)
    reason = retooled.diagnostics.cache_miss_reason if retooled.diagnostics else None
    assert isinstance(reason, anthropic.types.CacheMissToolsChanged)
    assert reason.cache_missed_input_tokens > 100

    changed = ask_claude(claude, messages, second.id, system=SYSTEM.replace("briefly", "in full"), stream=stream)
    reason = changed.diagnostics.cache_miss_reason if changed.diagnostics else None
    assert isinstance(reason, anthropic.types.CacheMissSystemChanged)
    assert reason.cache_missed_input_tokens > 100
    divergence = (reason.model_extra or {})["divergence"]
    assert divergence["message"] == "system" and divergence["line"] == 2


def test_anthropic_diagnostics_name_the_message_and_block_that_changed(
    claude: anthropic.Anthropic,
) -> None:
    messages: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "A double room from May 3 to May 5, please."}]}
    ]
    first = ask_claude(claude, messages, None)
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "With breakfast."}]
    second = ask_claude(claude, messages, first.id)
    edited = [
        {"role": "user", "content": [{"type": "text", "text": "A single room from May 3 to May 5, please."}]},
        *messages[1:],
    ]
    third = ask_claude(claude, edited, second.id)
    reason = third.diagnostics.cache_miss_reason if third.diagnostics else None
    assert isinstance(reason, anthropic.types.CacheMissMessagesChanged)
    divergence = (reason.model_extra or {})["divergence"]
    assert (divergence["message"], divergence["block"]) == (0, 0)
    assert divergence["token"] > 0


def test_an_unknown_or_another_tenants_message_is_not_found(make_proxy: Callable[..., LiveServer]) -> None:
    proxy = make_proxy(tenants=[{"name": "acme", "api_key": "sk-acme"}, {"name": "globex", "api_key": "sk-globex"}])
    acme = anthropic.Anthropic(base_url=proxy.url, api_key="sk-acme", max_retries=0)
    globex = anthropic.Anthropic(base_url=proxy.url, api_key="sk-globex", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "A double room from May 3 to May 5, please."}]
    theirs = ask_claude(acme, messages, None)
    for previous in (theirs.id, "msg_never_seen"):
        answer = ask_claude(globex, messages, previous)
        reason = answer.diagnostics.cache_miss_reason if answer.diagnostics else None
        assert isinstance(reason, anthropic.types.CacheMissPreviousMessageNotFound)


# -- OpenAI Responses and chat completions ---------------------------------------------------


@pytest.fixture
def gpt(proxy: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="anything", max_retries=0)


def respond(
    client: openai.OpenAI,
    items: list[Any],
    previous: str | None,
    *,
    instructions: str = SYSTEM,
    tools: list[Any] = TOOLS_OPENAI,
    stream: bool = False,
) -> Any:
    kwargs: dict[str, Any] = {
        "model": "fake-model",
        "instructions": instructions,
        "input": items,
        "tools": tools,
        "store": False,
        "max_output_tokens": 32,
    }
    if previous is not None:
        kwargs["prompt_cache_options"] = {"comparison_response_id": previous}
    if stream:
        with client.responses.stream(**kwargs) as events:
            return events.get_final_response()
    return client.responses.create(**kwargs)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_diagnostics_hit_input_and_tools_changes(
    gpt: openai.OpenAI, fake_backend: LiveServer, stream: bool
) -> None:
    items: list[Any] = [{"role": "user", "content": "A double room from May 3 to May 5, please."}]
    first = respond(gpt, items, None, stream=stream)
    items += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "With breakfast."}]
    second = respond(gpt, items, first.id, stream=stream)
    assert second.prompt_cache_diagnostics is not None and second.prompt_cache_diagnostics.type == "cache_hit"
    sent = forwarded(fake_backend, "/v1/responses")["body"]
    assert "comparison_response_id" not in str(sent.get("prompt_cache_options"))

    tools = [{**TOOLS_OPENAI[0], "description": "Rooms free between two dates."}]
    retooled = respond(gpt, items, second.id, tools=tools, stream=stream)
    found = retooled.prompt_cache_diagnostics
    assert found is not None and found.type == "cache_miss" and found.reason == "tools_changed"

    changed = respond(gpt, items, second.id, instructions=SYSTEM.replace("briefly", "in full"), stream=stream)
    found = changed.prompt_cache_diagnostics
    assert found is not None and found.type == "cache_miss"
    assert found.reason == "input_changed" and found.cache_missed_tokens > 100
    assert (found.model_extra or {})["divergence"]["message"] == "instructions"

    missing = respond(gpt, items, "resp_never_seen", stream=stream)
    assert missing.prompt_cache_diagnostics.type == "comparison_response_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_answer_the_same_diagnostics(gpt: openai.OpenAI, stream: bool) -> None:
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "A double room from May 3 to May 5, please."},
    ]

    def chat(previous: str | None) -> tuple[str, dict[str, Any] | None]:
        extra = {"prompt_cache_options": {"comparison_response_id": previous}} if previous else None
        if not stream:
            completion = gpt.chat.completions.create(
                model="fake-model", messages=messages, max_tokens=16, extra_body=extra
            )
            return completion.id, (completion.model_extra or {}).get("prompt_cache_diagnostics")
        chunks = list(
            gpt.chat.completions.create(
                model="fake-model", messages=messages, max_tokens=16, extra_body=extra, stream=True
            )
        )
        return chunks[0].id, (chunks[0].model_extra or {}).get("prompt_cache_diagnostics")

    first, _ = chat(None)
    messages += [{"role": "assistant", "content": "Certainly."}, {"role": "user", "content": "With breakfast."}]
    second, hit = chat(first)
    assert hit == {"type": "cache_hit"}
    messages[1] = {"role": "user", "content": "A single room from May 3 to May 5, please."}
    _, miss = chat(second)
    assert miss is not None and miss["type"] == "cache_miss" and miss["reason"] == "input_changed"
    assert miss["divergence"]["message"] == 1
