"""Compaction past a threshold (docs/compaction.md, "Compaction past a threshold"): Responses'
``context_management`` compaction entry and Anthropic's ``compact_20260112`` edit, served by the
proxy's summarizer against the fake vLLM, over real HTTP with the official SDKs: the compaction
item first in the answer, the turn answered on the summary and the turn it kept, and on the next
request everything before the item dropped, its prefix cached."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types.beta import BetaCompactionBlock, BetaMessage, BetaTextBlock
from openai.types.responses import Response, ResponseCompactionItem, ResponseOutputMessage

from proxy.app import create_app
from proxy.config import Settings
from summarizer.anchor import SUMMARY_HEADER
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer
from tests.test_compaction import INSTRUCTIONS, MODEL, SYSTEM, backend_requests, metric

THRESHOLD = 1_000
# An engineer's notes, as a user pastes them: numbered, multi-line, different on every line.
NOTES = "\n".join(
    f"{n}. The {kind} service on host db-{n:02d} answered in {n * 7 % 90 + 10} ms; "
    f"its {kind} queue held {n * 13 % 400} jobs and the replica lag was {n % 9}.{n % 7} s."
    for n, kind in enumerate(["billing", "search", "ledger", "auth", "mailer"] * 12, start=1)
)


def openai_client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def managed(threshold: int = THRESHOLD) -> list[dict[str, Any]]:
    return [{"type": "compaction", "compact_threshold": threshold}]


def respond(client: openai.OpenAI, items: list[Any], *, stream: bool) -> Response:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "input": items,
        "max_output_tokens": 40,
        "store": False,
        "context_management": managed(),
    }
    if not stream:
        return client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events))), numbers
    final = events[-1].response  # type: ignore[union-attr]
    added = [event for event in events if event.type == "response.output_item.added"]
    assert [event.output_index for event in added] == list(range(len(final.output)))
    deltas = {event.output_index for event in events if event.type == "response.output_text.delta"}
    assert deltas == {index for index, item in enumerate(final.output) if item.type == "message"}
    return final


def output_items(reply: Response) -> list[Any]:
    return [item.model_dump(exclude_none=True) for item in reply.output]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_compact_past_the_threshold(proxy: LiveServer, fake_backend: LiveServer, stream: bool) -> None:
    client = openai_client(proxy)
    topic = uuid.uuid4().hex[:8]
    first = {"type": "message", "role": "user", "content": f"Project {topic}: which service is slowest?\n{NOTES}"}
    reply = respond(client, [first], stream=stream)
    # Past the threshold, but one turn: nothing before it to compact; the field not forwarded.
    assert not any(isinstance(item, ResponseCompactionItem) for item in reply.output)
    assert "context_management" not in backend_requests(fake_backend, "/v1/responses")[-1]["body"]
    items = [first, *output_items(reply)]
    last = {"type": "message", "role": "user", "content": "Now compare the billing hosts with the search hosts."}
    items.append(last)
    before = len(backend_requests(fake_backend, "/v1/responses"))
    compacted = respond(client, items, stream=stream)
    Response.model_validate(compacted.model_dump())
    assert isinstance(compacted.output[0], ResponseCompactionItem)
    assert isinstance(compacted.output[1], ResponseOutputMessage)
    summary_request, turn = backend_requests(fake_backend, "/v1/responses")[before:]
    # The summary request is the history before the last turn, then the instruction: its prefix
    # is the previous turn's prompt and reply.
    assert summary_request["body"]["input"][:2] == items[:2]
    assert summary_request["cached_tokens"] > 0
    # The turn is answered on the summary and the turn it kept.
    summary = turn["body"]["input"][0]
    assert summary["role"] == "user" and summary["content"].startswith(SUMMARY_HEADER)
    assert turn["body"]["input"][1:] == [last]
    assert "context_management" not in turn["body"]
    # The next request appends as usual: what precedes the item is dropped, the prefix is cached.
    following = [*items, *output_items(compacted), {"type": "message", "role": "user", "content": "Thanks. Why?"}]
    answer = respond(client, following, stream=stream)
    # Below the threshold now: an ordinary turn.
    assert not any(isinstance(item, ResponseCompactionItem) for item in answer.output)
    forwarded = backend_requests(fake_backend, "/v1/responses")[-1]
    assert forwarded["body"]["input"][:2] == [summary, last]
    assert forwarded["body"]["input"][-1]["content"] == "Thanks. Why?"
    assert forwarded["cached_tokens"] >= turn["prompt_tokens"] - 16
    assert metric(proxy, "prefix_proxy_client_compactions_total", protocol="responses", outcome="served") >= 1


def test_no_second_summary_within_the_turn_it_kept(proxy: LiveServer, fake_backend: LiveServer) -> None:
    """An agent's loop of calls in the turn a compaction kept, past the threshold again: nothing
    before that turn but the summary, so it is not summarized again (that would only recompute it)."""
    client = openai_client(proxy)
    first = {"type": "message", "role": "user", "content": f"Read the notes ({uuid.uuid4().hex[:8]}):\n{NOTES}"}
    reply = respond(client, [first], stream=False)
    asked = {"type": "message", "role": "user", "content": "Check the ledger hosts' log."}
    items = [first, *output_items(reply), asked]
    compacted = respond(client, items, stream=False)
    assert isinstance(compacted.output[0], ResponseCompactionItem)
    call = {"type": "function_call", "call_id": "call_1", "name": "read_log", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "call_1", "output": NOTES}
    loop = [*items, compacted.output[0].model_dump(exclude_none=True), call, result]
    before = len(backend_requests(fake_backend, "/v1/responses"))
    again = respond(client, loop, stream=False)
    assert not any(isinstance(item, ResponseCompactionItem) for item in again.output)
    (forwarded,) = backend_requests(fake_backend, "/v1/responses")[before:]
    assert forwarded["body"]["input"][1:] == [asked, call, result]


def test_a_failed_summary_leaves_the_turn_as_sent(
    make_proxy: Callable[..., LiveServer], fake_backend: LiveServer
) -> None:
    """The summary cannot be made (its model is not served): the turn is answered uncompacted."""
    proxy = make_proxy(summarizer={"model": "no-such-model"})
    client = openai_client(proxy)
    first = {"type": "message", "role": "user", "content": f"Read the notes ({uuid.uuid4().hex[:8]}):\n{NOTES}"}
    items = [first, *output_items(respond(client, [first], stream=False))]
    items.append({"type": "message", "role": "user", "content": "Which host lags most?"})
    raw = client.responses.with_raw_response.create(
        model=MODEL, instructions=INSTRUCTIONS, input=items, max_output_tokens=40, store=False,
        context_management=managed(),  # type: ignore[arg-type]
    )  # fmt: skip
    assert "compaction_failed" in raw.headers["x-prefix-proxy-actions"]
    answer = raw.parse()
    assert not any(isinstance(item, ResponseCompactionItem) for item in answer.output)
    assert backend_requests(fake_backend, "/v1/responses")[-1]["body"]["input"] == items
    assert metric(proxy, "prefix_proxy_client_compactions_total", protocol="responses", outcome="failed") == 1


def test_responses_threshold_is_checked_as_openai_checks_it(proxy: LiveServer) -> None:
    client = openai_client(proxy)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", context_management=managed(999))  # type: ignore[arg-type]
    assert refused.value.code == "integer_below_min_value"
    assert refused.value.param == "context_management[0].compact_threshold"


# Anthropic's trigger is at least 50,000 input tokens: a pasted log that long, then one question.
LOG = "\n".join(
    f"2026-11-{n % 28 + 1:02d}T{n % 24:02d}:{n % 60:02d}:{n * 7 % 60:02d}Z worker-{n % 17} job={n * 7919 % 100003} "
    f"state={'ok' if n % 5 else 'retry'} took={n * 37 % 5000} ms queue={n % 41}"
    for n in range(3_200)
)
TRIGGER = {"type": "input_tokens", "value": 50_000}


@pytest.fixture(scope="module")
def long_context() -> Iterator[tuple[LiveServer, LiveServer]]:
    """A proxy before a fake vLLM of 128k context (Claude Code's models are), and that backend."""
    backend = LiveServer(create_fake_app(FakeBackendConfig(max_model_len=131_072))).start()
    proxy = LiveServer(create_app(Settings(upstream=backend.url + "/v1"))).start()
    yield proxy, backend
    proxy.stop()
    backend.stop()


def anthropic_turn(
    client: anthropic.Anthropic, messages: list[Any], *, stream: bool, pause: bool = False
) -> BetaMessage:
    edit: dict[str, Any] = {"type": "compact_20260112", "trigger": TRIGGER}
    if pause:
        edit["pause_after_compaction"] = True
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "system": SYSTEM,
        "messages": messages,
        "max_tokens": 40,
        "context_management": {"edits": [edit]},
        "betas": ["compact-2026-01-12"],
    }
    if not stream:
        return client.beta.messages.create(**kwargs)
    with client.beta.messages.stream(**kwargs) as events:
        for _ in events:
            pass
        return events.get_final_message()


def blocks(message: BetaMessage) -> list[Any]:
    return [block.model_dump(exclude_none=True) for block in message.content]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_compact_edit_past_its_trigger(long_context: tuple[LiveServer, LiveServer], stream: bool) -> None:
    proxy, fake_backend = long_context
    client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
    opening = {"role": "user", "content": f"Here is last month's worker log ({uuid.uuid4().hex[:8]}):\n{LOG}"}
    first = anthropic_turn(client, [opening], stream=stream)
    # One turn: nothing before it to compact, whatever its size.
    assert [block.type for block in first.content] == ["text"]
    messages = [opening, {"role": "assistant", "content": blocks(first)}]
    question = {"role": "user", "content": "Which worker retried most?"}
    messages.append(question)
    before = len(backend_requests(fake_backend, "/v1/messages"))
    compacted = anthropic_turn(client, messages, stream=stream)
    BetaMessage.model_validate(compacted.model_dump())
    block = compacted.content[0]
    assert isinstance(block, BetaCompactionBlock) and block.content and block.encrypted_content
    answer = compacted.content[1]
    assert isinstance(answer, BetaTextBlock) and answer.text  # its deltas reached the block they belong to
    assert compacted.usage.iterations is not None
    compaction, message = compacted.usage.iterations
    assert (compaction.type, message.type) == ("compaction", "message")
    assert message.output_tokens == compacted.usage.output_tokens > 0
    summary_request, turn = backend_requests(fake_backend, "/v1/messages")[before:]
    assert summary_request["body"]["messages"][:2] == messages[:2]
    assert summary_request["cached_tokens"] > 0
    assert turn["body"]["messages"] == [{"role": "user", "content": f"{SUMMARY_HEADER}\n{block.content}"}, question]
    assert "context_management" not in turn["body"]
    # Appended as usual: the messages before the block are dropped, the prefix is cached.
    following = [*messages, {"role": "assistant", "content": blocks(compacted)}, {"role": "user", "content": "Why?"}]
    anthropic_turn(client, following, stream=stream)
    forwarded = backend_requests(fake_backend, "/v1/messages")[-1]
    assert forwarded["body"]["messages"][:2] == turn["body"]["messages"]
    assert forwarded["body"]["messages"][2]["role"] == "assistant"
    assert forwarded["cached_tokens"] >= turn["prompt_tokens"] - 16


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_pause_after_compaction(long_context: tuple[LiveServer, LiveServer], stream: bool) -> None:
    proxy, fake_backend = long_context
    client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
    opening = {"role": "user", "content": f"The log ({uuid.uuid4().hex[:8]}):\n{LOG}"}
    first = anthropic_turn(client, [opening], stream=False)
    question = {"role": "user", "content": "Which job took longest?"}
    messages = [opening, {"role": "assistant", "content": blocks(first)}, question]
    paused = anthropic_turn(client, messages, stream=stream, pause=True)
    assert paused.stop_reason == "compaction"
    assert [block.type for block in paused.content] == ["compaction"]
    assert paused.usage.cache_read_input_tokens > 0  # the summary request's usage, its prefix cached
    # The client sends the compaction back and the conversation goes on from the summary.
    resumed = [*messages, {"role": "assistant", "content": blocks(paused)}]
    client.beta.messages.create(model=MODEL, system=SYSTEM, messages=resumed, max_tokens=20)
    forwarded = backend_requests(fake_backend, "/v1/messages")[-1]
    summary = paused.content[0]
    assert isinstance(summary, BetaCompactionBlock)
    assert forwarded["body"]["messages"] == [
        {"role": "user", "content": f"{SUMMARY_HEADER}\n{summary.content}"},
        question,
    ]


def test_anthropic_trigger_is_checked_as_anthropic_checks_it(proxy: LiveServer) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
        "context_management": {
            "edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 10}}]
        },
    }
    response = httpx.post(proxy.url + "/v1/messages", json=body, headers={"x-api-key": "x"})
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"
    assert "50000" in response.json()["error"]["message"]


def test_expansion_drops_what_the_latest_threshold_item_replaced() -> None:
    """Pure: before the latest item made past a threshold only instructions stay; the item becomes
    its summary and the turn it kept; an on-demand item (nothing kept) is expanded in place."""
    from proxy.chat import handoff
    from proxy.protocols import compaction as wire

    secret = b"k" * 32

    def unseal(value: object) -> handoff.Handoff | None:
        return handoff.unseal(secret, "t", value)

    kept = {"type": "message", "role": "user", "content": "second question"}
    past = wire.compaction_item(handoff.seal(secret, "t", "what came first", 3, [kept]))
    on_demand = wire.compaction_item(handoff.seal(secret, "t", "an older summary", 3))
    developer = {"type": "message", "role": "developer", "content": "Be brief."}
    items = [
        developer,
        on_demand,
        {"type": "message", "role": "user", "content": "first question"},
        {"type": "message", "role": "assistant", "content": "first answer"},
        kept,
        past,
        {"type": "message", "role": "assistant", "content": "second answer"},
        {"type": "message", "role": "user", "content": "third question"},
    ]
    expanded, count = wire.expand_responses({"input": items}, unseal)
    assert count == 1  # the on-demand item before it is dropped unopened
    assert expanded["input"] == [developer, wire.summary_item("what came first"), kept, *items[-2:]]
    # What is dropped is never opened: an item there that would not open does not matter.
    stale = [{"type": "compaction", "encrypted_content": "pp1.stale.key"}, *items[2:]]
    assert wire.expand_responses({"input": stale}, unseal)[0]["input"][0] == wire.summary_item("what came first")
    in_place, _ = wire.expand_responses({"input": items[:5]}, unseal)
    assert in_place["input"][1] == wire.summary_item("an older summary")

    asked = {"role": "user", "content": "second question"}
    block = wire.compaction_block("what came first", handoff.seal(secret, "t", "what came first", 3, [asked]))
    messages = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        asked,
        {"role": "assistant", "content": [block, {"type": "text", "text": "second answer"}]},
        {"role": "user", "content": "third question"},
    ]
    opened, count = wire.expand_messages({"messages": messages}, unseal)
    assert count == 1
    assert opened["messages"] == [
        {"role": "user", "content": wire.summary_text("what came first")},
        asked,
        {"role": "assistant", "content": [{"type": "text", "text": "second answer"}]},
        messages[-1],
    ]


def test_no_summary_for_a_turn_whose_budget_is_spent(fake_backend: LiveServer) -> None:
    """The tenant's budget is spent: the turn is refused (429) and no summary is made and charged first."""
    import asyncio

    from proxy.chat import usage_limits
    from tests.helpers import steady_window_s

    window = steady_window_s()
    tenant = {"name": "acme", "api_key": "sk-acme", "budget": {"tenant_tokens_per_window": 50_000, "window_s": window}}
    app = create_app(Settings(upstream=fake_backend.url + "/v1", tenants=[tenant]))
    proxy = LiveServer(app).start()
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-acme", max_retries=0)
        first = {"type": "message", "role": "user", "content": f"Read the notes ({uuid.uuid4().hex[:8]}):\n{NOTES}"}
        items = [first, *output_items(respond(client, [first], stream=False))]
        items.append({"type": "message", "role": "user", "content": "Which host lags most?"})
        state = app.state.proxy
        budget = state.settings.tenants[0].budget
        limits = usage_limits(budget, "acme", None)
        asyncio.run(state.sessions.store.charge(limits, 50_000, window, time.time()))  # spent elsewhere
        before = len(backend_requests(fake_backend, "/v1/responses"))
        with pytest.raises(openai.RateLimitError):
            respond(client, items, stream=False)
        assert backend_requests(fake_backend, "/v1/responses")[before:] == []
    finally:
        proxy.stop()
