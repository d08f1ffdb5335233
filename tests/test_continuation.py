"""Work resumed where a conversation's last request stops repeating (proxy.openai.continuation):
every part that resumes gives exactly what it gives from scratch, on conversations that grow,
fork, slide and edit; tenants never resume from each other; the memory stays in its bound."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.canon import layout
from proxy.canon.canonicalizer import Canonicalizer
from proxy.canon.engine import _inserted
from proxy.canon.toolcalls import anchors_of
from proxy.chat.budget import RequestSizes, request_bytes
from proxy.config import CanonSettings
from proxy.observability.digests import chain, digest_prompt
from proxy.openai import ToolCall
from proxy.openai.continuation import MIN_MESSAGES, Continuations, _KeptList, shared_prefix
from proxy.sessions.identity import conversation_fingerprints


def _conversation(seed: int, turns: int) -> list[dict[str, Any]]:
    """A system prompt, then user turns, assistant replies with tool calls, and tool results."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are agent {seed}.\nBe brief."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {seed}-{turn}: what now?"})
        if turn % 2:
            call = {
                "id": f"call_{seed}_{turn}",
                "type": "function",
                "function": {"name": "lookup", "arguments": f'{{"q": "{seed}-{turn}", "n": {turn}}}'},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"result {turn}"})
        messages.append({"role": "assistant", "content": f"answer {seed}-{turn}"})
    return messages


def test_shared_prefix_counts_the_leading_equal_messages() -> None:
    a = _conversation(1, 4)
    assert shared_prefix(a, copy.deepcopy(a)) == len(a)
    assert shared_prefix(a, [*copy.deepcopy(a), {"role": "user", "content": "more"}]) == len(a)
    edited = copy.deepcopy(a)
    edited[3] = {**edited[3], "content": "edited"}
    assert shared_prefix(a, edited) == 3
    assert shared_prefix(a, []) == 0


def _naive_shared(kept: list[Any], messages: list[Any]) -> int:
    count = 0
    for old, new in zip(kept, messages, strict=False):
        if old != new:
            break
        count += 1
    return count


@settings(max_examples=150, deadline=None)
@given(
    st.integers(4, 14),
    st.lists(
        st.tuples(st.sampled_from(["same", "copy", "edit", "grow", "tail", "insert", "replace"]), st.integers(0, 20)),
        min_size=1,
        max_size=10,
    ),
)
def test_shared_prefix_equals_comparing_by_value_whatever_was_compared_before(
    turns: int, derivations: list[tuple[str, int]]
) -> None:
    """Comparisons reuse what earlier ones found equal (the same objects, or the objects of a prefix
    found equal by value lately, at any offset): whatever was compared before, in whatever order,
    the count is the one comparing every message by value gives."""
    previous = _conversation(7, turns)
    lists = [previous, copy.deepcopy(previous)]
    for kind, amount in derivations:
        base = lists[amount % len(lists)]
        if kind == "same":
            derived = list(base)
        elif kind == "copy":
            derived = copy.deepcopy(base)
        elif kind == "edit":
            derived = list(base)
            if derived:
                at = amount % len(derived)
                derived[at] = {**derived[at], "content": f"edited {amount}"}
        elif kind == "grow":
            derived = [*base, {"role": "user", "content": f"more {amount}"}]
        elif kind == "tail":
            derived = base[1 + amount % 3 :]
        elif kind == "insert":
            derived = list(base)
            derived.insert(amount % (len(base) + 1), {"role": "system", "content": f"block {amount}"})
        else:  # an equal copy of one message
            derived = list(base)
            if derived:
                at = amount % len(derived)
                derived[at] = copy.deepcopy(derived[at])
        lists.append(derived)
        for other in (lists[0], lists[-2], lists[amount % len(lists)]):
            assert shared_prefix(other, derived) == _naive_shared(other, derived)
            assert shared_prefix(derived, other) == _naive_shared(derived, other)
            # A list a memory keeps (held as it is by the prefixes found equal).
            assert shared_prefix(_KeptList(other), derived) == _naive_shared(other, derived)


def test_a_conversation_resumes_from_its_last_request_and_no_other_tenants() -> None:
    memory: Continuations[str] = Continuations()
    first = _conversation(1, 3)
    resumed = memory.resume("tenant-a", first)
    assert (resumed.shared, resumed.state) == (0, None)
    resumed.keep(first, "state of the first")
    grown = [*copy.deepcopy(first), {"role": "user", "content": "and then?"}]
    resumed = memory.resume("tenant-a", grown)
    assert (resumed.shared, resumed.state) == (len(first), "state of the first")
    # The same conversation sent by another tenant finds nothing.
    assert memory.resume("tenant-b", grown).shared == 0


class _Counted(dict[str, Any]):
    """A message that counts how often it is compared by value."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _Counted.compared += 1
        return dict.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]


def test_a_kept_list_that_cannot_share_more_is_not_compared() -> None:
    """Each request of a conversation parsed afresh (every message a new object): its history is
    compared by value with the conversation's last request once, not again with the request before
    that, which holds fewer messages than were found shared (a 1,000-turn history compared twice).
    Each request ends with a line of its own after the history (a clock moved before the question),
    which the next one does not re-send."""
    memory: Continuations[int] = Continuations()
    base = _conversation(3, 40)
    for turns in range(len(base) - 6, len(base)):
        moved = {"role": "system", "content": f"Current time: 12:{turns:02d}"}
        messages = [_Counted(message) for message in copy.deepcopy([*base[:turns], moved])]
        _Counted.compared = 0
        resumed = memory.resume("t", messages)
        resumed.keep(messages, turns)
        if resumed.state is not None:
            assert resumed.shared == turns - 1
            # Once to find where the lists part (and half again, halving), not once more per kept list.
            assert _Counted.compared <= 2 * turns + 4, (turns, _Counted.compared)


def test_conversations_that_open_alike_both_resume() -> None:
    memory: Continuations[int] = Continuations()
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    one = [*opening, {"role": "assistant", "content": "hello, one"}, {"role": "user", "content": "1"}]
    two = [*opening, {"role": "assistant", "content": "hello, two"}, {"role": "user", "content": "2"}]
    for number, messages in enumerate((one, two)):
        memory.resume("t", messages).keep(messages, number)
    assert memory.resume("t", [*one, {"role": "user", "content": "x"}]).state == 0
    assert memory.resume("t", [*two, {"role": "user", "content": "x"}]).state == 1


def test_the_memory_forgets_past_its_bound() -> None:
    memory: Continuations[int] = Continuations(max_chars=10_000)

    def conversation(number: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"conversation {number} " + "x" * 500}] * MIN_MESSAGES

    for number in range(100):
        memory.resume("t", conversation(number)).keep(conversation(number), number)
    assert 0 < len(memory) < 20
    assert memory.resume("t", conversation(99)).state == 99
    assert memory.resume("t", conversation(0)).state is None


def test_a_short_list_is_worked_out_whole() -> None:
    memory: Continuations[int] = Continuations()
    short = _conversation(1, 1)[: MIN_MESSAGES - 1]
    memory.resume("t", short).keep(short, 1)
    assert len(memory) == 0
    assert memory.resume("t", short).shared == 0


# A request of a conversation: its history so far, or a variation of it a client really sends.
_steps = st.lists(
    st.tuples(st.sampled_from(["grow", "grow", "grow", "fork", "slide", "edit_system", "new"]), st.integers(0, 3)),
    min_size=2,
    max_size=12,
)


def _requests(steps: list[tuple[str, int]]) -> list[list[dict[str, Any]]]:
    requests = []
    seed, turns = 0, 1
    for kind, amount in steps:
        messages = _conversation(seed, turns)
        if kind == "grow":
            turns += amount + 1
            messages = _conversation(seed, turns)
        elif kind == "fork":
            messages = [*messages[:-1], {"role": "assistant", "content": f"another answer {amount}"}]
        elif kind == "slide":
            messages = messages[:1] + messages[1 + 2 * amount :]
        elif kind == "edit_system":
            messages[0] = {"role": "system", "content": f"You are agent {seed}.\nToday is day {amount}."}
        else:
            seed += 1
            turns = amount + 1
            messages = _conversation(seed, turns)
        # Parsed afresh, as every request is: equal values, never the same objects.
        requests.append(copy.deepcopy(messages))
    return requests


@settings(max_examples=80, deadline=None)
@given(_steps)
def test_resumed_parts_equal_their_work_from_scratch(steps: list[tuple[str, int]]) -> None:
    # One memory for the parts that read the forwarded messages, as the proxy has it; the budget's
    # sizes sometimes read another list (a summary put in), as where a summary is applied.
    forwarded: Continuations[Any] = Continuations()
    anchored: Continuations[Any] = Continuations()
    sizes = RequestSizes(forwarded)
    for number, messages in enumerate(_requests(steps)):
        body: dict[str, Any] = {"model": "m", "messages": messages}
        if number % 3 == 1:  # tools sent with some requests only: they size and head every digest
            body["tools"] = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]

        resumed = forwarded.resume("t", messages, "digests")
        prompt = digest_prompt(body, "t", previous=resumed.state, shared=resumed.shared)
        resumed.keep(messages, prompt)
        fresh = digest_prompt(body, "t")
        assert (prompt.digests, prompt.ends, prompt.roles, prompt.system_lines) == (
            fresh.digests,
            fresh.ends,
            fresh.roles,
            fresh.system_lines,
        )
        assert chain(prompt) == chain(fresh)

        resumed = forwarded.resume("t", messages, "fingerprints")
        pairs, last, state = conversation_fingerprints(messages, resumed.state, resumed.shared)
        resumed.keep(messages, state)
        fresh_pairs, fresh_last, _ = conversation_fingerprints(messages)
        assert pairs == fresh_pairs
        assert (last[0] if last else None) is (fresh_last[0] if fresh_last else None)
        assert (last[1] if last else None) == (fresh_last[1] if fresh_last else None)

        sized = body
        if number % 4 == 2:
            summary = {"role": "user", "content": f"Summary of the conversation so far ({number})."}
            sized = {**body, "messages": [*messages[:1], summary, *messages[3:]]}
        assert request_bytes(sized, sizes, "t") == request_bytes(sized)

        resumed = anchored.resume("t", messages)
        anchors = anchors_of(messages, resumed.state, resumed.shared)
        resumed.keep(messages, anchors)
        assert anchors == anchors_of(messages)


def _without_resumption(canonicalizer: Canonicalizer) -> Canonicalizer:
    """The canonicalizer with memories that never keep a conversation: everything from scratch."""
    canonicalizer.tool_memory.anchored = Continuations(max_chars=0)
    canonicalizer.tool_memory.called = Continuations(max_chars=0)
    assert canonicalizer.layouts is not None
    canonicalizer.layouts.digested = Continuations(max_chars=0)
    return canonicalizer


def _agent_requests(conversations: int, turns: int) -> list[dict[str, Any]]:
    """Agents whose system prompt carries a clock line that moves, whose client re-sends its tool
    calls with fresh ids, and which sometimes regenerate a reply or slide their window."""
    rules = "\n".join(f"Rule {n}: read before you edit, and say what you changed." for n in range(30))
    requests = []
    for seed in range(conversations):
        for turn in range(1, turns):
            clock = turn if seed % 2 else 0  # half of them with a clock that moves
            system = f"You are agent {seed % 2}.\nCurrent time: 2026-12-0{clock % 9 + 1} 10:{clock:02d}\n{rules}"
            history = _conversation(seed, turn)[1:]
            for message in history:
                for call in message.get("tool_calls") or ():
                    call["id"] = f"call_fresh_{seed}_{turn}_{call['id']}"  # a client that makes new ids
            if turn % 4 == 3:
                history = history[4:]  # a window that slid
            if turn % 5 == 4:
                history[-1] = {"role": "assistant", "content": f"regenerated {turn}"}
            body: dict[str, Any] = {"model": "m", "messages": [{"role": "system", "content": system}, *history]}
            if turn % 3 == 0:  # the tools sent with some turns only: another header for the chains
                body["tools"] = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
            requests.append(body)
    return requests


@pytest.mark.parametrize("writes_kept", [4096, 1])
def test_canonicalization_resumed_forwards_what_it_forwards_from_scratch(
    writes_kept: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where blocks are in a history is taken from the last request and the blocks written since
    # (``ForwardedLayouts.written_since``); with one write kept, looked for again whenever more came.
    monkeypatch.setattr(layout, "WRITES_KEPT", writes_kept)
    resumed, fresh = Canonicalizer(CanonSettings()), _without_resumption(Canonicalizer(CanonSettings()))
    for body in _agent_requests(conversations=4, turns=10):
        ours, theirs = resumed.apply(copy.deepcopy(body), "t"), fresh.apply(copy.deepcopy(body), "t")
        assert ours.body == theirs.body
        assert [str(a) for a in ours.actions] == [str(a) for a in theirs.actions]
        assert (ours.prefix_hash, ours.stable_count) == (theirs.prefix_hash, theirs.stable_count)
        # The messages it made, where relocation put them, as a look through all of them finds them.
        sent, forwarded = body["messages"], ours.body["messages"]
        scanned = _inserted(sent, forwarded, ours.stable_count) if len(forwarded) != len(sent) else ()
        assert ours.inserted == theirs.inserted == scanned
        calls = [ToolCall(id=f"gen_{len(body['messages'])}", name="lookup", arguments='{"q": 1}')]
        resumed.record_reply(ours.body, "t", calls)
        fresh.record_reply(theirs.body, "t", calls)
    assert len(resumed.tool_memory.anchored) > 0 and len(fresh.tool_memory.anchored) == 0
    # The layouts remembered (chains of the prompts forwarded) are the same ones, in the same order.
    assert resumed.layouts is not None and fresh.layouts is not None
    assert list(resumed.layouts._prompts._members) == list(fresh.layouts._prompts._members)


def test_anything_a_client_sends_is_looked_up_without_error() -> None:
    """The nesting check looks before validation: roles and contents of any JSON type."""
    memory: Continuations[None] = Continuations()
    for messages in (
        [{"role": ["user"], "content": "x"}] * MIN_MESSAGES,
        [{"role": {"a": 1}, "content": [1, 2]}] * MIN_MESSAGES,
        [1, "two", None, [3]],
        [{"role": "user", "content": [{"text": ["not text"]}]}] * MIN_MESSAGES,
        [{"role": "user", "content": {"a": [1, {"b": None}]}}] * MIN_MESSAGES,
    ):
        resumed = memory.resume("t", messages)
        resumed.keep(messages, None)
        assert memory.resume("t", list(messages)).shared == len(messages)


def test_the_memories_stay_at_their_bound_however_many_conversations_pass(capsys: Any) -> None:
    from bench import continuation_rss

    continuation_rss.main(["--conversations", "2500"])
    kept = int(capsys.readouterr().out.rsplit(":", 1)[1].replace(",", ""))
    assert 500 < kept < 2500  # the bound, not the conversations sent, decides


def test_a_list_validated_as_chat_is_validated_again_as_anthropic() -> None:
    """One tenant's memory of checked messages serves both protocols: what one protocol found
    valid must not pass the other's check (a "tool" role is chat's, not Anthropic's)."""
    from proxy.http import InvalidRequest
    from proxy.http.body import validate_chat_request
    from proxy.protocols.anthropic import validate_request

    messages = [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "result"},
        {"role": "user", "content": "and now?"},
    ]
    validate_chat_request({"model": "m", "messages": copy.deepcopy(messages)}, "t")
    validate_chat_request({"model": "m", "messages": copy.deepcopy(messages)}, "t")
    with pytest.raises(InvalidRequest):
        validate_request({"model": "m", "max_tokens": 8, "messages": copy.deepcopy(messages)}, namespace="t")


def test_a_block_equal_to_a_system_message_the_client_sent_counts_as_the_clients() -> None:
    """What canonicalization made is where relocation put it, less what equals a system message
    the client sent (in its history too): as a look through all the messages finds it."""
    requests = [
        body for body in _agent_requests(conversations=2, turns=8) if "agent 1" in body["messages"][0]["content"]
    ]
    ours, theirs = Canonicalizer(CanonSettings()), Canonicalizer(CanonSettings())
    for body in requests[:-1]:
        ours.apply(copy.deepcopy(body), "t")
        theirs.apply(copy.deepcopy(body), "t")
    last = requests[-1]
    made = ours.apply(copy.deepcopy(last), "t")
    assert made.inserted, "the clock moved: a block before the last user turn"
    block = made.body["messages"][made.inserted[0]]
    echoed = copy.deepcopy(last)
    echoed["messages"].insert(2, dict(block))  # the client sent that very system message before
    found = theirs.apply(echoed, "t")
    forwarded = found.body["messages"]
    assert block in forwarded
    assert found.inserted == _inserted(echoed["messages"], forwarded, found.stable_count)
    assert all(forwarded[index] != block for index in found.inserted)


@pytest.mark.parametrize("writes_kept", [4096, 2])
def test_blocks_a_conversation_had_are_restored_resumed_as_from_scratch(
    writes_kept: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Conversations that open alike (one writes blocks into the history the others share) and
    whose clock lines come back (a block's lines in the system prompt again: restored where it
    was): forwarded alike, resumed (blocks taken from the last request and those written since)
    or from scratch."""
    import random

    monkeypatch.setattr(layout, "WRITES_KEPT", writes_kept)
    rules = "\n".join(f"Rule {n}: check the order before you answer." for n in range(20))
    for seed in range(6):
        rng = random.Random(seed)
        resumed, fresh = Canonicalizer(CanonSettings()), _without_resumption(Canonicalizer(CanonSettings()))
        turns = [1, 1, 1]
        for _ in range(40):
            which = rng.randrange(3)
            turns[which] += rng.choice([0, 1, 1, 2])
            clock = rng.choice([0, 1, 2])
            system = f"You are the order desk.\nCurrent time: 2026-12-04 10:0{clock}\n{rules}"
            # Conversations 0 and 1 share their history (the same seed): one's blocks sit in the other's.
            history = _conversation(which // 2, turns[which])[1:]
            body = {"model": "m", "messages": [{"role": "system", "content": system}, *history]}
            ours, theirs = resumed.apply(copy.deepcopy(body), "t"), fresh.apply(copy.deepcopy(body), "t")
            assert ours.body == theirs.body
            assert [str(a) for a in ours.actions] == [str(a) for a in theirs.actions]
            assert ours.inserted == theirs.inserted
