"""A system prompt that gains lines mid-conversation (an app's memory block, a document added) keeps
the conversation's prefix: the new lines go before the last user turn, whole and byte-identical,
and stay there while unchanged; a conversation's first turn and an edited stable line go as sent.

Seen with the real Open WebUI app: a tool call adds to the user's memories, and from the next request
on every chat of that user carries a ``<memory_context>`` block at the end of its system prompt. As
sent, each chat recomputed its 36 tools and its whole history (6.9k tokens) on that request."""

from __future__ import annotations

import json
from typing import Any

from proxy.canon.canonicalizer import Canonicalizer
from proxy.config import CanonSettings

PERSONA = [
    "You are Bench Assistant, a concise helper for a small team.",
    "Answer in one or two sentences and say so when you are unsure.",
]
RULES = [
    "You are talking with Ada; address them by name only when greeting.",
    "Prefer plain language and use lists only when asked.",
    "Never invent facts about the user's files or projects.",
]
MEMORY = "<memory_context>\n[User Memory]\n- works on the billing team\n- prefers short answers\n</memory_context>"
TOOLS = [{"type": "function", "function": {"name": f"tool_{n}", "parameters": {"type": "object"}}} for n in range(8)]


def system(second: int, memory: str = "", rules: list[str] = RULES) -> str:
    clock = f"Today's date is 2026-12-03 and the local time is 09:{second // 60:02d}:{second % 60:02d}."
    return "\n".join([*PERSONA, clock, *rules, *([memory] if memory else [])])


def body(system_prompt: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system_prompt}, *history], "tools": TOOLS}


def dumped(messages: list[dict[str, Any]]) -> list[str]:
    return [json.dumps(m, sort_keys=True) for m in messages]


def common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Chat:
    """One chat of the app: each turn's system prompt as the app renders it then."""

    def __init__(self, canonicalizer: Canonicalizer, name: str) -> None:
        self.canonicalizer = canonicalizer
        self.name = name
        self.history: list[dict[str, Any]] = []
        self.forwarded: list[dict[str, Any]] = []

    def turn(self, system_prompt: str, question: str) -> tuple[list[dict[str, Any]], list[str]]:
        self.history.append({"role": "user", "content": question})
        result = self.canonicalizer.apply(body(system_prompt, self.history), "tenant")
        self.forwarded = result.body["messages"]
        self.history.append({"role": "assistant", "content": f"{self.name}: an answer to {question!r}."})
        return self.forwarded, [str(a) for a in result.actions]


def warm_app(canonicalizer: Canonicalizer, chats: int = 2) -> list[Chat]:
    """Two chats of two turns each: the clock line has been seen to vary and moves."""
    opened = [Chat(canonicalizer, f"chat {n}") for n in range(chats)]
    second = 0
    for turn in range(2):
        for chat in opened:
            second += 1
            chat.turn(system(second), f"[{chat.name}, turn {turn}] What should I look at next?")
    return opened


def test_a_block_added_mid_conversation_goes_before_the_last_turn_whole() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    chat = warm_app(canonicalizer)[0]
    before = list(chat.forwarded)
    sent = system(30, MEMORY)
    forwarded, actions = chat.turn(sent, "[chat 0, turn 2] And the memory?")
    assert "volatile_moved:mid_conversation" in actions, actions
    # The system message the conversation was forwarded with, then the history up to the block.
    assert forwarded[0] == before[0]
    assert forwarded[-1] == {"role": "user", "content": "[chat 0, turn 2] And the memory?"}
    block = forwarded[-2]
    assert block["role"] == "system"
    assert MEMORY in block["content"] and "09:00:30" in block["content"]
    # Every client line arrives once, byte-identical: the system prompt's lines are the stable
    # system message's and the block's.
    assert sorted(forwarded[0]["content"].split("\n") + block["content"].split("\n")) == sorted(sent.split("\n"))


def test_the_next_turn_finds_the_block_where_the_conversation_had_it() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    chat = warm_app(canonicalizer)[0]
    chat.turn(system(30, MEMORY), "[chat 0, turn 2] And the memory?")
    previous = dumped(chat.forwarded) + dumped(chat.history[-1:])
    # A tool loop's second request carries the same system prompt (the same second).
    chat.history.append({"role": "user", "content": "[chat 0] go on"})
    result = chat.canonicalizer.apply(body(system(30, MEMORY), chat.history), "tenant")
    forwarded = dumped(result.body["messages"])
    assert forwarded[: len(previous)] == previous, [str(a) for a in result.actions]


def test_another_chat_of_the_app_gaining_the_same_block_moves_it_too() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    first, second = warm_app(canonicalizer)
    first.turn(system(30, MEMORY), "[chat 0, turn 2] And the memory?")
    before = list(second.forwarded)
    # The same block, identical to what the app sent before, is new to this conversation.
    forwarded, actions = second.turn(system(31, MEMORY), "[chat 1, turn 2] And the memory?")
    assert "volatile_moved:mid_conversation" in actions, actions
    assert forwarded[0] == before[0]
    assert MEMORY in forwarded[-2]["content"]


def test_a_conversations_first_turn_keeps_a_block_the_app_sent_before_in_place() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    first, second = warm_app(canonicalizer)
    first.turn(system(30, MEMORY), "[chat 0, turn 2] And the memory?")
    second.turn(system(31, MEMORY), "[chat 1, turn 2] And the memory?")
    fresh = Chat(canonicalizer, "chat 2")
    forwarded, actions = fresh.turn(system(40, MEMORY), "[chat 2, turn 0] Hello")
    assert "volatile_moved:mid_conversation" not in actions
    assert forwarded[0]["content"].endswith(MEMORY), actions


def test_an_edited_stable_line_mid_conversation_goes_as_sent() -> None:
    """What stays after moving the new lines was never forwarded: the change is not only those lines,
    so nothing is gained by moving them."""
    canonicalizer = Canonicalizer(CanonSettings())
    chat = warm_app(canonicalizer)[0]
    edited = [RULES[0], "Prefer plain language; use tables for comparisons.", RULES[2]]
    forwarded, actions = chat.turn(system(30, MEMORY, edited), "[chat 0, turn 2] And the memory?")
    assert "volatile_moved:mid_conversation" not in actions
    assert MEMORY in forwarded[0]["content"]


def test_without_the_layout_memory_nothing_moves_mid_conversation() -> None:
    canonicalizer = Canonicalizer(CanonSettings(remember_layouts=False))
    chat = warm_app(canonicalizer)[0]
    _, actions = chat.turn(system(30, MEMORY), "[chat 0, turn 2] And the memory?")
    assert "volatile_moved:mid_conversation" not in actions


def test_a_conversation_this_replica_never_forwarded_goes_as_sent() -> None:
    """Its earlier turns went out from another replica with the block in place (memories not
    shared), so the backend holds the block where the client put it: moving it now would cost the
    turn its whole history, although this replica forwarded the shorter system prompt for others."""
    replica_a, replica_b = Canonicalizer(CanonSettings()), Canonicalizer(CanonSettings())
    warm_app(replica_b)  # replica B knows the app's system prompt without the block
    chat = Chat(replica_a, "chat x")
    for turn in range(2):
        chat.turn(system(20 + turn, MEMORY), f"[chat x, turn {turn}] What should I look at next?")
    chat.canonicalizer = replica_b
    forwarded, actions = chat.turn(system(30, MEMORY), "[chat x, turn 2] And the memory?")
    assert "volatile_moved:mid_conversation" not in actions, actions
    assert MEMORY in forwarded[0]["content"]


def test_a_conversation_without_a_user_turn_gets_no_block_after_its_tool_result() -> None:
    """An agent's loop that sends the system prompt, its calls and their results (no user turn):
    there is no place before a user turn, and a system message after a tool result is a shape
    strict templates refuse."""
    canonicalizer = Canonicalizer(CanonSettings())
    warm_app(canonicalizer)
    call = {"id": "call_1", "type": "function", "function": {"name": "tool_1", "arguments": "{}"}}
    history = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    for second in (30, 31):
        result = canonicalizer.apply(body(system(second, MEMORY), history), "tenant")
        assert "volatile_moved:mid_conversation" not in [str(a) for a in result.actions]
        assert result.body["messages"][-1] == history[-1]
