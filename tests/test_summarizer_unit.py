"""Summarizer pure parts: what to fold, how the summary is anchored, the request it sends."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.openai.messages import message_fingerprint
from summarizer import Compactor, CompactorOptions, SummaryPolicy, SummaryState, anchor, needed_soon, plan_chunk
from summarizer.anchor import SUMMARY_HEADER
from summarizer.compactor import CompactionFailed
from summarizer.prompt import build_request

SYSTEM = {"role": "system", "content": "You are helpful."}


def conversation(turns: int, with_tools: bool = False) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [SYSTEM]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}"})
        if with_tools and i % 2 == 0:
            call = {"id": f"call_{i}", "type": "function", "function": {"name": "search", "arguments": "{}"}}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"result {i}"})
        messages.append({"role": "assistant", "content": f"answer {i}"})
    return messages


def test_chunk_ends_at_a_user_turn_and_keeps_the_last_turns() -> None:
    messages = conversation(8)
    chunk = plan_chunk(messages, 1, SummaryPolicy(keep_last_turns=3))
    assert chunk is not None
    assert messages[chunk.end]["role"] == "user"
    assert sum(1 for m in messages[chunk.end :] if m["role"] == "user") == 3


def test_nothing_to_fold_when_only_kept_turns_remain() -> None:
    assert plan_chunk(conversation(3), 1, SummaryPolicy(keep_last_turns=3)) is None


@pytest.mark.parametrize("keep", [0, 1, 2, 3, 5])
def test_tool_calls_never_separated_from_their_results(keep: int) -> None:
    messages = conversation(9, with_tools=True)
    chunk = plan_chunk(messages, 1, SummaryPolicy(keep_last_turns=keep))
    assert chunk is not None
    folded_calls = {c["id"] for m in messages[chunk.start : chunk.end] for c in m.get("tool_calls") or []}
    folded_results = {m["tool_call_id"] for m in messages[chunk.start : chunk.end] if m["role"] == "tool"}
    assert folded_calls == folded_results


def state_covering(messages: list[dict[str, Any]], text: str = "they talked") -> SummaryState:
    return SummaryState(text=text, covered={message_fingerprint(m) for m in messages}, version=1)


def test_anchor_replaces_covered_messages_whatever_the_client_resends() -> None:
    messages = conversation(6)
    state = state_covering(messages[1:7])
    full = anchor(messages, state, insert_at=1)
    assert full.messages[1]["content"].startswith(SUMMARY_HEADER)
    assert full.messages[2:] == messages[7:]
    assert full.removed == 6
    # The client's window slid: it re-sends only part of the covered messages, or none.
    partial = anchor([SYSTEM, *messages[4:]], state, insert_at=1)
    none = anchor([SYSTEM, *messages[7:]], state, insert_at=1)
    assert partial.messages == full.messages == none.messages


def test_anchor_can_put_the_summary_inside_the_system_message_ahead_of_its_volatile_tail() -> None:
    """For templates that take one system message (Mistral, Gemma)."""
    messages = conversation(6)
    state = state_covering(messages[1:7])
    inside = anchor(messages, state, insert_at=1, into_system=True)
    assert [m["role"] for m in inside.messages].count("system") == 1
    assert inside.messages[0]["content"] == f"You are helpful.\n\n{SUMMARY_HEADER}\nthey talked"
    assert inside.messages[1:] == messages[7:]
    assert "summary_in_system_message" in inside.actions

    tail = "Current time: 14:03"
    volatile = [{"role": "system", "content": f"You are helpful.\n\n{tail}"}, *messages[1:]]
    placed = anchor(volatile, state, insert_at=1, into_system=True, system_tail=tail)
    # The summary stays in the stable prefix: before the moved lines, which change every request.
    assert placed.messages[0]["content"] == f"You are helpful.\n\n{SUMMARY_HEADER}\nthey talked\n\n{tail}"

    # Nothing to merge into: a system message of its own, first (which such templates accept).
    assert anchor(messages[1:], state, insert_at=0, into_system=True).messages[0]["content"].startswith(SUMMARY_HEADER)
    # A system prompt sent as text parts gets the summary as a part, before the moved lines' part.
    stable_part, tail_part = {"type": "text", "text": "You are helpful."}, {"type": "text", "text": tail}
    parts = [{"role": "system", "content": [stable_part, tail_part]}, *messages[1:]]
    merged = anchor(parts, state, insert_at=1, into_system=True, system_tail=tail).messages
    assert merged[0]["content"] == [stable_part, {"type": "text", "text": f"{SUMMARY_HEADER}\nthey talked"}, tail_part]
    assert merged[1:] == messages[7:]
    image = {"role": "system", "content": [stable_part, {"type": "image_url", "image_url": {"url": "data:,"}}]}
    assert (
        anchor([image, *messages[1:]], state, insert_at=1, into_system=True)
        .messages[1]["content"]
        .startswith(SUMMARY_HEADER)
    )


def test_window_repair_restores_dropped_messages() -> None:
    messages = conversation(5)
    state = SummaryState(tail=messages[1:9])
    client = [SYSTEM, *messages[5:]]  # the client dropped the first four messages
    repaired = anchor(client, state, insert_at=1, repair=True)
    assert repaired.messages == messages
    assert repaired.restored == 4
    edited = [SYSTEM, {"role": "user", "content": "something else"}, *messages[6:]]
    assert anchor(edited, state, insert_at=1, repair=True).messages == edited


async def test_compactor_builds_an_incremental_cache_reusing_request() -> None:
    sent: list[dict[str, Any]] = []

    async def complete(body: dict[str, Any]) -> tuple[str, int]:
        sent.append(body)
        return "new summary", 3

    tools = [{"type": "function", "function": {"name": "search"}}]
    messages = anchor(conversation(8), state_covering(conversation(2)[1:]), insert_at=1).messages
    compactor = Compactor(complete, SummaryPolicy(keep_last_turns=2), CompactorOptions(max_summary_tokens=50))
    result = await compactor.compact(state_covering(conversation(2)[1:]), {"model": "m", "tools": tools}, messages, 2)
    assert result is not None
    request = sent[0]
    # The conversation as forwarded, then the instruction: the prefix is the one the backend cached.
    assert request["messages"][:-1] == messages[: len(request["messages"]) - 1]
    assert request["messages"][1]["content"].startswith(SUMMARY_HEADER), "the old summary is merged in"
    assert request["tools"] == tools and request["tool_choice"] == "none"
    assert request["max_tokens"] == 50
    assert result.state.version == 2 and result.state.text == "new summary"
    assert message_fingerprint(messages[2]) in result.state.covered


async def test_failed_summary_changes_nothing() -> None:
    async def complete(body: dict[str, Any]) -> tuple[str, int]:
        return "   ", 0

    compactor = Compactor(complete, SummaryPolicy(keep_last_turns=1), CompactorOptions())
    state = SummaryState()
    with pytest.raises(CompactionFailed):
        await compactor.compact(state, {"model": "m"}, conversation(5), 1)
    assert state == SummaryState()


def test_summary_request_stays_in_the_conversations_cache_namespace() -> None:
    forwarded = {"model": "m", "messages": conversation(2), "cache_salt": "pp-tenant-salt"}
    request = build_request(forwarded, conversation(2), instruction="Summarize.", max_tokens=100)
    assert request["cache_salt"] == "pp-tenant-salt"
    assert "cache_salt" not in build_request({**forwarded, "cache_salt": None}, [], instruction="", max_tokens=1)


def test_summary_request_renders_as_the_conversation_did() -> None:
    """What the template reads (a reasoning effort some write into the system block, the template's
    switches) goes with the summary request: without it the prefix renders differently."""
    from proxy.protocols import RESPONSES

    switches = {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}
    forwarded = {"model": "m", "messages": conversation(2), **switches}
    request = build_request(forwarded, conversation(2), instruction="Summarize.", max_tokens=100)
    assert {key: request[key] for key in switches} == switches
    body = {"model": "m", "input": "Plan the migration.", "reasoning": {"effort": "high"}}
    view = RESPONSES.view(body, None, "t")
    summary = RESPONSES.channel(view).request({**view.chat, "messages": [*view.chat["messages"]]})
    assert summary["reasoning"] == {"effort": "high"}


BLOCK = {"role": "system", "content": "Current time: 17:44:59"}  # a block relocation inserted


def test_anchored_positions_follow_the_summary_and_the_restored_messages() -> None:
    messages = conversation(3)  # S q0 a0 q1 a1 q2 a2
    # The summary replaces q0 and a0; the proxy's block sits before q2 (index 5 of the input).
    sent = [SYSTEM, *messages[1:5], BLOCK, messages[5]]
    anchored = anchor(sent, state_covering(messages[1:3]), insert_at=1)
    assert [anchored.position(i) for i in range(len(sent))] == [0, None, None, 2, 3, 4, 5]
    assert anchored.messages[4] == BLOCK
    # A repaired window: q0 and a0 restored before what the client re-sent.
    window = [SYSTEM, *messages[3:5], BLOCK, messages[5]]
    repaired = anchor(window, SummaryState(tail=messages[1:5]), insert_at=1, repair=True)
    assert repaired.restored == 2
    assert [repaired.messages[p] for p in map(repaired.position, range(len(window))) if p is not None] == window


async def test_the_repair_tail_of_a_compaction_leaves_the_proxys_blocks_out() -> None:
    async def complete(body: dict[str, Any]) -> tuple[str, int]:
        return "summary", 3

    messages = conversation(6)
    forwarded = [*messages[:-2], BLOCK, *messages[-2:]]  # the block before the last question
    compactor = Compactor(complete, SummaryPolicy(keep_last_turns=2), CompactorOptions(repair=True))
    result = await compactor.compact(SummaryState(), {"model": "m"}, forwarded, 1, inserted={len(messages) - 2})
    assert result is not None and result.state.tail
    assert BLOCK not in result.state.tail
    assert result.state.tail == messages[-4:]  # the kept turns, as the client sent them


async def test_the_saved_repair_tail_never_holds_a_message_the_proxy_inserted() -> None:
    from proxy.chat.compaction import CompactionJob, CompactionService
    from proxy.config import SessionSettings, SummarizerSettings
    from proxy.observability.metrics import Metrics
    from proxy.protocols.channel import CHAT
    from proxy.sessions.memory import MemorySessionStore
    from proxy.sessions.service import SessionService
    from proxy.tenants import Tenant

    metrics = Metrics()
    sessions = SessionService(MemorySessionStore(ttl_s=60), SessionSettings(), metrics)
    service = CompactionService(SummarizerSettings(), sessions, None, None, metrics)  # type: ignore[arg-type]
    forwarded = [SYSTEM, BLOCK, *conversation(2)[1:]]  # the block before the first question
    job = CompactionJob(
        tenant=Tenant("t"),
        session_id="s",
        summary=SummaryState(),
        forwarded={"model": "m", "messages": forwarded},
        messages=forwarded,
        history_start=1,
        channel=CHAT,
        upstream_auth={},
        routing_key="k",
        prefix_hash="p",
        slides_window=True,
        tokens_per_byte=None,
        inserted=frozenset({1}),
    )
    await service.after_answer(job, due=False)
    record = await sessions.get("t", "s")
    assert record is not None
    tail = SummaryState.from_json(record.summary).tail
    assert tail == forwarded[2:] and BLOCK not in tail


def test_a_summary_is_needed_soon_only_where_the_growth_reaches_its_use() -> None:
    # 20k of a 24.5k budget, growing 300 tokens a request (a short reply): 15 requests away.
    assert not needed_soon(20_000, 50, 19_700, 24_500, requests=4)
    assert needed_soon(20_000, 50, 19_700, 24_500, requests=15)
    # Growing 2k a request: within 3.
    assert needed_soon(20_000, 50, 18_000, 24_500, requests=4)
    # A request sent again (regenerated): it grows by its reply at the least.
    assert not needed_soon(20_000, 100, 20_000, 24_500, requests=4)
    assert needed_soon(20_000, 1_200, 20_000, 24_500, requests=4)
    # The reply alone takes it there: the next request needs the summary.
    assert needed_soon(30_000, 2_500, 30_000, 32_000, requests=4)
    # Already where the summary is used, the first request of a session, or no lookahead.
    assert needed_soon(24_600, 50, 24_500, 24_500, requests=4)
    assert needed_soon(20_000, 50, 0, 24_500, requests=4)
    assert needed_soon(20_000, 50, 19_700, 24_500, requests=0)


@settings(max_examples=120, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(0, 30),
    st.lists(st.integers(0, 40), max_size=3),
    st.booleans(),
)
def test_anchor_finds_what_the_summary_stands_for_from_the_known_fingerprints_as_by_reading(
    turns: int, covered_count: int, system_at: list[int], tools: bool
) -> None:
    """The messages a summary stands for, found from the session's fingerprints and the budget's
    sizes in passes of C (``Known``), are those fingerprinting each message finds: system messages
    inside the history (blocks of moved lines, a summary) included."""
    from proxy.chat.budget import message_ends
    from proxy.sessions.identity import conversation_fingerprints
    from summarizer.anchor import Known

    messages = conversation(turns, with_tools=tools)
    for at in sorted(system_at, reverse=True):
        messages.insert(1 + at % len(messages), {"role": "system", "content": f"moved block {at}"})
    covered = {message_fingerprint(m) for m in messages[1 : 1 + covered_count]}
    state = SummaryState(text="the summary", covered=covered, version=1)
    _, _, fingerprinted = conversation_fingerprints(messages)
    known = Known(fingerprinted.previous, fingerprinted.counts, message_ends(messages))
    fast, slow = anchor(messages, state, 1, known=known), anchor(messages, state, 1)
    assert (fast.messages, fast.removed, fast.removed_bytes) == (slow.messages, slow.removed, slow.removed_bytes)


async def test_a_summary_that_fits_extends_the_whole_conversation_and_leaves_the_kept_turns_out() -> None:
    """With room in the engine's context, the request is the whole conversation (the prompt a slot
    engine holds) and the instruction names what stays verbatim; without it, the folded turns only."""
    sent: list[dict[str, Any]] = []

    async def complete(body: dict[str, Any]) -> tuple[str, int]:
        sent.append(body)
        return "summary", 2

    messages = conversation(6)
    compactor = Compactor(complete, SummaryPolicy(keep_last_turns=2), CompactorOptions(max_summary_tokens=400))
    await compactor.compact(SummaryState(), {"model": "m"}, messages, 1, room=300)
    whole = sent[-1]
    assert whole["messages"][:-1] == messages
    assert "Leave out the last 2 exchanges" in whole["messages"][-1]["content"]
    assert 0 < whole["max_tokens"] < 300, "the summary fits in what the context leaves"
    await compactor.compact(SummaryState(), {"model": "m"}, messages, 1, room=40)
    short = sent[-1]
    assert short["messages"][:-1] == messages[:9] and short["max_tokens"] == 400
    await compactor.compact(SummaryState(), {"model": "m"}, messages, 1)
    assert sent[-1] == short, "room unknown: the folded turns only"
