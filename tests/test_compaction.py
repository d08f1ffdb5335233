"""Compaction a client asks for (docs/compaction.md): Responses' compaction_trigger and
/v1/responses/compact, Anthropic's compaction parameter, served by the proxy's summarizer against
the fake vLLM, over real HTTP with the official SDKs; and the token that carries the summary."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types.beta import BetaCompactionBlock, BetaMessage
from openai.types.responses import CompactedResponse, Response, ResponseCompactionItem, ResponseUsage
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.chat import handoff
from proxy.config import Settings
from summarizer.anchor import SUMMARY_HEADER
from tests.helpers import LiveServer

MODEL = "fake-model"
INSTRUCTIONS = "You are a careful software agent. Explain what you do.\n" * 8
SYSTEM = "You are a coding agent. Follow the repository's conventions.\n" * 8
BETA = ["compact-2026-09-04"]


def backend_requests(backend: LiveServer, endpoint: str) -> list[dict[str, Any]]:
    log = httpx.get(backend.url + "/fake/requests", params={"limit": 512}).json()
    return [r for r in log if r["endpoint"] == endpoint]


def metric(proxy: LiveServer, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(proxy.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


def openai_client(server: LiveServer, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def first_turn(client: openai.OpenAI, topic: str) -> list[Any]:
    """One answered turn: the conversation's input items, reply included (as Codex keeps them)."""
    items: list[Any] = [{"type": "message", "role": "user", "content": f"Plan the migration of {topic} to Postgres."}]
    reply = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=items, max_output_tokens=40, store=False
    )
    return items + [item.model_dump(exclude_none=True) for item in reply.output]


def trigger(client: openai.OpenAI, items: list[Any], *, stream: bool) -> Response:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "input": [*items, {"type": "compaction_trigger"}],
        "store": False,
    }
    if not stream:
        return client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    done = [event.item for event in events if event.type == "response.output_item.done"]
    final = events[-1].response  # type: ignore[union-attr]
    assert done == final.output
    return final


# -- the token ---------------------------------------------------------------------------------


def test_token_opens_for_its_tenant_only() -> None:
    secret = b"s" * 32
    token = handoff.seal(secret, "acme", "The user wants Postgres 17; é ✓", 12)
    assert handoff.seal(secret, "acme", "The user wants Postgres 17; é ✓", 12) == token  # deterministic
    assert token.isascii() and token.startswith("pp1.")
    assert handoff.unseal(secret, "acme", token) == handoff.Handoff("The user wants Postgres 17; é ✓", 12)
    assert handoff.unseal(secret, "globex", token) is None
    assert handoff.unseal(b"t" * 32, "acme", token) is None
    version, body, mac = token.split(".")
    altered = body[:-2] + ("A" if body[-2] != "A" else "B") + body[-1]
    for bad in (f"{version}.{altered}.{mac}", f"pp2.{body}.{mac}", f"{version}.{body}", token + "x", "", 7, None, "é"):
        assert handoff.unseal(secret, "acme", bad) is None


# -- Responses: compaction_trigger ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_trigger_is_answered_with_one_compaction_item(
    proxy: LiveServer, fake_backend: LiveServer, stream: bool
) -> None:
    client = openai_client(proxy)
    items = first_turn(client, f"billing-{uuid.uuid4().hex[:8]}")
    response = trigger(client, items, stream=stream)
    Response.model_validate(response.model_dump())
    assert response.status == "completed"
    assert len(response.output) == 1
    item = response.output[0]
    assert isinstance(item, ResponseCompactionItem) and item.encrypted_content.startswith("pp1.")
    # The summary request: the conversation as it was forwarded plus the instruction, no trigger;
    # its prefix (the instructions, the turn and the reply the backend generated) hit the cache.
    summary = backend_requests(fake_backend, "/v1/responses")[-1]
    assert summary["body"]["input"][: len(items)] == items
    assert summary["body"]["input"][-1]["role"] == "user" and "summary" in summary["body"]["input"][-1]["content"]
    assert not any(i.get("type") == "compaction_trigger" for i in summary["body"]["input"])
    assert summary["body"]["stream"] is False
    assert summary["cached_tokens"] > 0
    assert response.usage is not None
    assert response.usage.input_tokens == summary["prompt_tokens"]
    assert response.usage.input_tokens_details.cached_tokens == summary["cached_tokens"]
    assert metric(proxy, "prefix_proxy_client_compactions_total", protocol="responses", outcome="served") >= 1


def test_compaction_item_sent_back_is_the_same_summary_every_turn(proxy: LiveServer, fake_backend: LiveServer) -> None:
    client = openai_client(proxy)
    items = first_turn(client, f"ledger-{uuid.uuid4().hex[:8]}")
    item = trigger(client, items, stream=False).output[0].model_dump(exclude_none=True)
    # As Codex continues: the user messages it kept, the compaction item, the new turns.
    history: list[Any] = [items[0], item]
    forwarded = []
    for turn in ("Go on with step one.", "Now step two."):
        history.append({"type": "message", "role": "user", "content": turn})
        reply = client.responses.create(
            model=MODEL, instructions=INSTRUCTIONS, input=history, max_output_tokens=30, store=False
        )
        history.extend(o.model_dump(exclude_none=True) for o in reply.output)
        forwarded.append(backend_requests(fake_backend, "/v1/responses")[-1])
    summaries = [r["body"]["input"][1] for r in forwarded]
    assert summaries[0] == summaries[1]
    assert summaries[0]["role"] == "user" and summaries[0]["content"].startswith(SUMMARY_HEADER + "\n")
    assert not any(i.get("type") == "compaction" for r in forwarded for i in r["body"]["input"])
    # The second turn's prompt hits through the summary block and the first turn after it.
    assert forwarded[1]["cached_tokens"] >= forwarded[0]["prompt_tokens"] - 16
    assert metric(proxy, "prefix_proxy_client_compaction_items_total", protocol="responses", outcome="expanded") >= 2


def test_another_tenants_or_an_altered_item_is_refused(fake_backend: LiveServer) -> None:
    tenants = [{"name": "acme", "api_key": "sk-acme"}, {"name": "globex", "api_key": "sk-globex"}]
    proxy = LiveServer(create_app(Settings(upstream=fake_backend.url + "/v1", tenants=tenants))).start()
    try:
        acme, globex = openai_client(proxy, "sk-acme"), openai_client(proxy, "sk-globex")
        items = first_turn(acme, f"orders-{uuid.uuid4().hex[:8]}")
        item = trigger(acme, items, stream=False).output[0].model_dump(exclude_none=True)
        before = len(backend_requests(fake_backend, "/v1/responses"))
        follow = [items[0], item, {"type": "message", "role": "user", "content": "Continue."}]
        accepted = acme.responses.create(model=MODEL, input=follow, max_output_tokens=10, store=False)
        assert accepted.output  # forwarded and answered
        token = item["encrypted_content"]
        altered = {**item, "encrypted_content": token[:10] + ("A" if token[10] != "A" else "B") + token[11:]}
        for client, sent in ((globex, item), (acme, altered), (acme, {**item, "encrypted_content": "ENC2"})):
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(model=MODEL, input=[sent, follow[2]], max_output_tokens=10, store=False)
            error = refused.value.body
            assert isinstance(error, dict)
            assert error["code"] == "invalid_compaction_item"
            assert error["param"] == "input[0].encrypted_content"
            assert "Send the conversation without it" in error["message"]
        assert len(backend_requests(fake_backend, "/v1/responses")) == before + 1  # none of them forwarded
        assert metric(proxy, "prefix_proxy_client_compaction_items_total", protocol="responses", outcome="refused") == 3
    finally:
        proxy.stop()


def test_responses_compact_endpoint(proxy: LiveServer, fake_backend: LiveServer) -> None:
    client = openai_client(proxy)
    items = first_turn(client, f"search-{uuid.uuid4().hex[:8]}")
    items.append({"type": "message", "role": "user", "content": "And the indexes?"})
    raw = client.responses.with_raw_response.compact(model=MODEL, instructions=INSTRUCTIONS, input=items)
    compacted = raw.parse()
    assert isinstance(compacted, CompactedResponse)
    assert compacted.object == "response.compaction"
    # The user messages, as sent, then one compaction item. (The SDK's output union has no user
    # message type, so only the compaction item and the usage are validated strictly.)
    output = raw.http_response.json()["output"]
    assert output[:-1] == [items[0], items[-1]]
    ResponseCompactionItem.model_validate(output[-1])
    ResponseUsage.model_validate(raw.http_response.json()["usage"])
    assert isinstance(compacted.output[-1], ResponseCompactionItem)
    summary = backend_requests(fake_backend, "/v1/responses")[-1]
    assert summary["cached_tokens"] > 0
    assert compacted.usage.input_tokens_details.cached_tokens == summary["cached_tokens"]
    # The output is the next request's input.
    following = list(output)
    following.append({"type": "message", "role": "user", "content": "Thanks."})
    reply = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=following, max_output_tokens=10)
    assert reply.output
    sent = backend_requests(fake_backend, "/v1/responses")[-1]["body"]["input"]
    assert sent[2]["content"].startswith(SUMMARY_HEADER)


def test_previous_response_chains_are_not_compacted(proxy: LiveServer) -> None:
    client = openai_client(proxy)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.compact(model=MODEL, previous_response_id="resp_abc", input=[])
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_trigger_not_last_is_refused(proxy: LiveServer) -> None:
    client = openai_client(proxy)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model=MODEL, input=[{"type": "compaction_trigger"}, {"type": "message", "role": "user", "content": "hi"}]
        )


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_summary_is_an_error_not_an_item(stream: bool) -> None:
    # Nothing listens there: the summary request cannot be sent.
    dead = LiveServer(create_app(Settings(upstream="http://127.0.0.1:9/v1"))).start()
    try:
        client = openai_client(dead)
        items: list[Any] = [{"type": "message", "role": "user", "content": "hello"}]
        with pytest.raises(openai.InternalServerError) as failed:
            trigger(client, items, stream=stream)
        assert failed.value.status_code == 502
        assert failed.value.body["code"] == "upstream_unreachable"  # type: ignore[index]
        anthropic_client = anthropic.Anthropic(base_url=dead.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.InternalServerError) as failed_messages:
            anthropic_client.beta.messages.create(
                model=MODEL, max_tokens=100, messages=items, compaction={"type": "summarize"}, betas=BETA
            )
        assert failed_messages.value.status_code == 502
        assert failed_messages.value.body["type"] == "error"  # type: ignore[index]
        assert metric(dead, "prefix_proxy_client_compactions_total", protocol="responses", outcome="failed") == 1
        assert metric(dead, "prefix_proxy_client_compactions_total", protocol="messages", outcome="failed") == 1
    finally:
        dead.stop()


# -- Anthropic Messages: compaction: {type: summarize} -----------------------------------------


def anthropic_turn(client: anthropic.Anthropic, topic: str) -> list[Any]:
    messages: list[Any] = [{"role": "user", "content": f"Plan the migration of {topic} to Postgres."}]
    reply = client.messages.create(model=MODEL, system=SYSTEM, messages=messages, max_tokens=40)
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
    return messages


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_compaction_round_trip(proxy: LiveServer, fake_backend: LiveServer, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
    messages = anthropic_turn(client, f"payroll-{uuid.uuid4().hex[:8]}")
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "system": SYSTEM,
        "messages": messages,
        "max_tokens": 1024,
        "compaction": {"type": "summarize"},
        "betas": BETA,
    }
    if stream:
        with client.beta.messages.stream(**kwargs) as events:
            kinds = [event.type for event in events]
            message = events.get_final_message()
        assert {"message_start", "content_block_start", "content_block_delta", "message_stop"} <= set(kinds)
    else:
        message = client.beta.messages.create(**kwargs)
    BetaMessage.model_validate(message.model_dump())
    assert message.stop_reason == "compaction"
    assert len(message.content) == 1
    block = message.content[0]
    assert isinstance(block, BetaCompactionBlock) and block.content and block.encrypted_content
    summary = backend_requests(fake_backend, "/v1/messages")[-1]
    assert "compaction" not in summary["body"]
    assert summary["body"]["messages"][: len(messages)] == messages
    assert summary["cached_tokens"] > 0
    assert message.usage.cache_read_input_tokens == summary["cached_tokens"]
    # Sent back first, in an assistant message, in place of what it summarizes.
    history: list[Any] = [{"role": "assistant", "content": [block.model_dump(exclude_none=True)]}]
    forwarded = []
    for turn in ("Go on.", "And then?"):
        history.append({"role": "user", "content": turn})
        reply = client.beta.messages.create(model=MODEL, system=SYSTEM, messages=history, max_tokens=20, betas=BETA)
        history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        forwarded.append(backend_requests(fake_backend, "/v1/messages")[-1])
    first = [r["body"]["messages"][0] for r in forwarded]
    assert first[0] == first[1] == {"role": "user", "content": f"{SUMMARY_HEADER}\n{block.content}"}
    assert forwarded[1]["cached_tokens"] >= forwarded[0]["prompt_tokens"] - 16


def test_anthropic_compaction_instructions_and_refusals(
    make_proxy: Callable[..., LiveServer], fake_backend: LiveServer
) -> None:
    proxy = make_proxy()
    client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
    messages = anthropic_turn(client, f"crm-{uuid.uuid4().hex[:8]}")
    client.beta.messages.create(
        model=MODEL,
        messages=messages,
        system=SYSTEM,
        max_tokens=100,
        compaction={"type": "summarize", "instructions": "Summarize only the decisions."},
        betas=BETA,
    )
    sent = backend_requests(fake_backend, "/v1/messages")[-1]["body"]["messages"][-1]
    assert sent == {"role": "user", "content": "Summarize only the decisions."}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.beta.messages.create(
            model=MODEL,
            max_tokens=10,
            messages=[
                {
                    "role": "assistant",
                    "content": [{"type": "compaction", "content": "x", "encrypted_content": "forged"}],
                },
                {"role": "user", "content": "hi"},
            ],
            betas=BETA,
        )
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "messages[0].content[0]" in refused.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        client.post(
            "/v1/messages",
            body={"model": MODEL, "max_tokens": 10, "messages": messages, "compaction": {"type": "other"}},
            cast_to=object,
        )


TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "list_files",
        "description": "List the files of a directory",
        "parameters": {"type": "object", "properties": {"dir": {"type": "string"}}},
    }
]


def test_tokens_saved_against_a_local_compaction_without_tools(proxy: LiveServer, fake_backend: LiveServer) -> None:
    """Codex compacts locally without the tools: what the proxy's request read from the cache past
    them is counted (an estimate: the turns and the instruction, less the summary's prefill)."""
    client = openai_client(proxy)
    before = metric(proxy, "prefix_proxy_client_compaction_tokens_saved_total", protocol="responses")
    items: list[Any] = [{"type": "message", "role": "user", "content": f"Audit {uuid.uuid4().hex} for dead code."}]
    reply = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=60
    )
    items += [o.model_dump(exclude_none=True) for o in reply.output]
    answer = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=[*items, {"type": "compaction_trigger"}], tools=TOOLS
    )
    assert [o.type for o in answer.output] == ["compaction"]
    summary = backend_requests(fake_backend, "/v1/responses")[-1]
    assert summary["body"]["tools"] == TOOLS and summary["body"]["tool_choice"] == "none"
    saved = metric(proxy, "prefix_proxy_client_compaction_tokens_saved_total", protocol="responses") - before
    assert 0 < saved < summary["cached_tokens"]


def test_expansion_is_pure_and_keeps_what_is_not_a_compaction() -> None:
    from proxy.protocols import compaction as wire

    secret = b"k" * 32
    token = handoff.seal(secret, "t", "the summary", 3)

    def unseal(value: object) -> handoff.Handoff | None:
        return handoff.unseal(secret, "t", value)

    body = {
        "model": MODEL,
        "max_tokens": 5,
        "messages": [
            {"role": "assistant", "content": [{"type": "compaction", "content": "x", "encrypted_content": token}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "kept"},
                    {"type": "compaction", "content": "x", "encrypted_content": token},
                ],
            },
            {"role": "user", "content": "hi"},
        ],
    }
    expanded, count = wire.expand_messages(body, unseal)
    text = f"{SUMMARY_HEADER}\nthe summary"
    assert count == 2
    assert expanded["messages"][0] == {"role": "user", "content": text}
    assert expanded["messages"][1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "kept"}, {"type": "text", "text": text}],
    }
    assert expanded["messages"][2] is body["messages"][2]  # type: ignore[index]
    assert wire.expand_messages({"messages": [{"role": "user", "content": "x"}]}, unseal)[1] == 0
    responses_body = {"model": MODEL, "input": [{"type": "compaction", "encrypted_content": token}, "odd"]}
    out, count = wire.expand_responses(responses_body, unseal)
    assert count == 1 and out["input"] == [{"type": "message", "role": "user", "content": text}, "odd"]
    assert wire.expand_responses(out, unseal)[0] is out  # idempotent: nothing left to expand


def test_a_key_of_the_process_own_is_told_once(
    make_proxy: Callable[..., LiveServer], caplog: pytest.LogCaptureFixture
) -> None:
    """With the in-memory store and no cache_salt_secret, tokens die with the process: the operator
    is told at the first compaction, once; a configured secret says nothing."""
    told = "they stop opening after a restart"
    for secret, expected in ((None, 1), ("a-secret-of-32-characters-at-least!", 0)):
        proxy = make_proxy(**({"cache_salt_secret": secret} if secret else {}))
        client = openai_client(proxy)
        caplog.clear()
        with caplog.at_level("WARNING", logger="prefix_proxy.compaction"):
            for topic in ("billing", "search"):
                trigger(client, first_turn(client, topic), stream=False)
        assert sum(told in record.getMessage() for record in caplog.records) == expected
