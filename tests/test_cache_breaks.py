"""Miss explanation (proxy.observability): one cause per request, from hashes of forwarded prompts."""

from __future__ import annotations

import json
from typing import Any

from proxy.observability.breaks import CAUSES, BreakMemory, CacheBreak
from proxy.observability.digests import digest_prompt, message_hash

SYSTEM = "You are the support bot of ACME.\nCurrent time: 2024-05-01 10:00:00\nAnswer briefly and politely."
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "book", "parameters": {"type": "object"}}},
]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def body(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "m", "messages": messages}
    if tools:
        out["tools"] = tools
    return out


class Conversation:
    """Sends turns through a BreakMemory as the proxy does, replies recorded as generated."""

    def __init__(self, memory: BreakMemory, key: str | None, system: str = SYSTEM) -> None:
        self.memory, self.key = memory, key
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]

    def send(self, text: str, reply: str | None = None, **kwargs: Any) -> CacheBreak:
        self.messages.append(user(text))
        result, prompt_id = self.memory.observe(digest_prompt(body(self.messages, **kwargs)), self.key)
        answer = assistant(reply or f"answer to {text} " * 10)
        self.memory.record_reply(prompt_id, *message_hash(answer))
        self.messages.append(answer)
        return result


def observe(memory: BreakMemory, messages: list[dict[str, Any]], key: str | None = "c1", **kwargs: Any) -> CacheBreak:
    summary_at = kwargs.pop("summary_at", -1)
    moved = kwargs.pop("moved_volatile", False)
    system_count = kwargs.pop("system_count", None)
    prompt = digest_prompt(body(messages, **kwargs), summary_at=summary_at, system_count=system_count)
    result, _ = memory.observe(prompt, key, moved_volatile=moved)
    return result


def test_first_request_of_an_app_is_a_new_conversation_and_appending_is_no_break() -> None:
    memory = BreakMemory()
    chat = Conversation(memory, "c1")
    first = chat.send("hello " * 40)
    assert first.cause == "new_conversation" and first.message == 0 and first.tokens_lost > 0
    for turn in range(3):
        result = chat.send(f"question {turn} " * 20)
        assert result.cause == "none" and result.tokens_lost == 0
        # The whole previous prompt and the reply the backend generated are cached.
        assert result.expected_bytes == digest_prompt(body(chat.messages[:-1])).bytes_at(len(chat.messages) - 2)


def test_another_conversation_of_the_app_reuses_the_system_prompt() -> None:
    memory = BreakMemory()
    Conversation(memory, "c1").send("first conversation " * 10)
    result = Conversation(memory, "c2").send("second conversation " * 10)
    assert result.cause == "new_conversation" and result.message == 1
    # Only the new part is lost: the system prompt is expected to hit.
    assert result.expected_bytes == len(SYSTEM.encode())


def test_changed_system_line_is_named_within_a_conversation_and_across_conversations() -> None:
    memory = BreakMemory()
    chat = Conversation(memory, "c1")
    chat.send("hi " * 30)
    chat.messages[0]["content"] = SYSTEM.replace("10:00:00", "10:00:07")
    result = chat.send("again " * 30)
    assert (result.cause, result.message, result.line) == ("system_changed", 0, 2)
    assert result.tokens_lost > 0 and result.expected_bytes == 0
    # A new conversation of the same app, whose timestamp moved on again.
    other = Conversation(memory, "c2", SYSTEM.replace("10:00:00", "10:01:00"))
    result = other.send("hello " * 30)
    assert (result.cause, result.message, result.line) == ("system_changed", 0, 2)
    # A different app (no line in common) is a new conversation, not a changed prompt.
    result = Conversation(memory, "c3", "Another app entirely.\nWith its own prompt.").send("x " * 30)
    assert result.cause == "new_conversation"


def test_tools_reordered() -> None:
    memory = BreakMemory()
    chat = Conversation(memory, "c1")
    chat.send("hi " * 30, tools=TOOLS)
    result = chat.send("more " * 30, tools=list(reversed(TOOLS)))
    assert (result.cause, result.message) == ("tools_changed", -1)
    assert result.expected_bytes == 0


def test_history_edited_names_the_message() -> None:
    memory = BreakMemory()
    chat = Conversation(memory, "c1")
    for turn in range(3):
        chat.send(f"turn {turn} " * 20)
    chat.messages[3] = user("an edited question " * 20)
    result = chat.send("next " * 20)
    assert (result.cause, result.message) == ("history_edited", 3)


def test_sliding_window_is_history_trimmed() -> None:
    memory = BreakMemory()
    chat = Conversation(memory, "c1")
    for turn in range(4):
        chat.send(f"turn {turn} " * 20)
    del chat.messages[1:3]  # the client's window dropped the oldest pair
    result = chat.send("next " * 20)
    assert (result.cause, result.message) == ("history_trimmed", 1)


def test_another_first_question_on_the_same_key_is_a_new_conversation_not_an_edit() -> None:
    # A chat app's title task, then its follow-up task, in the chat's session: one-shot requests
    # with the same system prompt and another question each.
    memory = BreakMemory()
    Conversation(memory, "c1").send("### Task: write a title for this chat " * 10)
    result = Conversation(memory, "c1").send("### Task: suggest follow-up questions " * 10)
    assert result.cause == "new_conversation"
    edited = Conversation(memory, "c2")
    edited.send("first " * 20)
    edited.send("second " * 20)
    edited.messages[3] = user("an edited second question " * 10)
    assert edited.send("third " * 20).cause == "history_edited"


def test_reply_re_sent_differently_is_model_output_rewritten_but_tool_call_ids_are_not() -> None:
    memory = BreakMemory()
    messages = [{"role": "system", "content": SYSTEM}, user("book it " * 10)]
    _, prompt_id = memory.observe(digest_prompt(body(messages, TOOLS)), "c1")
    generated = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "book", "arguments": '{"day": "mon", "n": 2}'}}
        ],
    }
    memory.record_reply(prompt_id, *message_hash(generated))
    # Fresh id, arguments re-dumped ASCII-escaped with other spacing: renders the same bytes.
    same = json.loads(json.dumps(generated))
    same["tool_calls"][0]["id"] = "call_fresh"
    same["tool_calls"][0]["function"]["arguments"] = json.dumps({"day": "mon", "n": 2}, separators=(",", ":"))
    same["content"] = ""
    tool = {"role": "tool", "tool_call_id": "call_fresh", "content": "booked"}
    result = observe(memory, [*messages, same, tool], tools=TOOLS)
    assert result.cause == "none"
    # Arguments with their keys in another order render differently.
    rewritten = json.loads(json.dumps(generated))
    rewritten["tool_calls"][0]["function"]["arguments"] = '{"n": 2, "day": "mon"}'
    result = observe(memory, [*messages, rewritten, tool], key="c2", tools=TOOLS)
    assert (result.cause, result.message) == ("model_output_rewritten", 2)


def test_moved_volatile_block_and_summary() -> None:
    memory = BreakMemory()
    block = {"role": "system", "content": "Current time: 10:00"}
    # Inserted before the last user turn: not part of the stable system prompt (canon's stable_count).
    first = [{"role": "system", "content": "Stable."}, block, user("q1 " * 30)]
    observe(memory, first, system_count=1)
    second = [{"role": "system", "content": "Stable."}, user("q1 " * 30), assistant("a1 " * 30), block, user("q2")]
    result = observe(memory, second, system_count=1)
    assert (result.cause, result.message) == ("volatile_moved", 1)

    memory = BreakMemory()
    history = [{"role": "system", "content": "Stable."}]
    for turn in range(4):
        history += [user(f"q{turn} " * 30), assistant(f"a{turn} " * 30)]
    observe(memory, [*history, user("q4")])
    summary = {"role": "system", "content": "Summary of the conversation so far: ..."}
    compacted = [history[0], summary, *history[5:], user("q4"), assistant("a4"), user("q5")]
    result = observe(memory, compacted, summary_at=1)
    assert (result.cause, result.message) == ("summary_compacted", 1)


def test_settle_flags_eviction_only_past_the_tolerance() -> None:
    memory = BreakMemory(block_size=16)
    chat = Conversation(memory, "c1")
    chat.send("hello " * 200)
    result = chat.send("more " * 10)
    assert result.cause == "none"
    prompt_tokens = 600
    expected_share = result.expected_bytes / result.prompt_bytes
    expected = int(prompt_tokens * expected_share) // 16 * 16
    served = expected - 16  # within two blocks: estimates are per byte
    near = CacheBreak(prompt_bytes=result.prompt_bytes, expected_bytes=result.expected_bytes)
    near.settle(prompt_tokens, served)
    assert near.cause == "none" and near.expected_cached == expected
    result.settle(prompt_tokens, 0)
    assert result.cause == "cache_evicted" and result.tokens_lost == expected
    assert result.header() == f"cache_evicted; tokens={expected}"
    result.settle(prompt_tokens, expected)  # settles once
    assert result.cause == "cache_evicted"


def test_header_and_json_carry_no_text() -> None:
    memory = BreakMemory()
    chat = Conversation(memory, "c1")
    chat.send("secret words " * 20)
    chat.messages[0]["content"] = "secret prompt"
    result = chat.send("x")
    assert result.header().startswith("system_changed; message=0; line=1; tokens=")
    assert "secret" not in result.header() + json.dumps(result.to_json())
    assert result.cause in CAUSES


def test_memory_is_bounded() -> None:
    memory = BreakMemory(max_prompts=50)
    for index in range(500):
        observe(memory, [{"role": "system", "content": f"app {index}"}, user(f"q {index}")], key=f"c{index}")
    assert len(memory) == 50
    assert len(memory._links) <= 50 * 8 and len(memory._conversations) <= 50


def test_a_changed_system_prompt_with_other_tools_is_system_changed() -> None:
    """Another agent (a sub-agent, a side task) changes the prompt from the system prompt on; its tools
    with it. Only tools changing under an identical system prompt read tools_changed."""
    memory = BreakMemory()
    chat = Conversation(memory, "c1")
    chat.send("hi " * 30, tools=TOOLS)
    chat.messages[0]["content"] = SYSTEM.replace("10:00:00", "10:00:07")
    result = chat.send("again " * 30, tools=TOOLS[:1])
    assert (result.cause, result.message, result.line) == ("system_changed", 0, 2)
    assert result.expected_bytes == 0 and result.tokens_lost > 0
    # A system prompt no longer there at all, other tools: system_changed too.
    result = observe(memory, [user("a title for: hi")], key="c1")
    assert (result.cause, result.message, result.line) == ("system_changed", 0, None)
    # A conversation's first request, compared with the app's closest prompt: the same rule.
    other = Conversation(memory, "c2", SYSTEM.replace("support bot", "search sub-agent"))
    result = other.send("find " * 30, tools=[{"type": "function", "function": {"name": "grep"}}])
    assert (result.cause, result.message, result.line) == ("system_changed", 0, 1)
    same_system = Conversation(memory, "c3", SYSTEM.replace("10:00:00", "10:00:07"))
    result = same_system.send("hello " * 30, tools=list(reversed(TOOLS)))
    assert (result.cause, result.message) == ("tools_changed", -1)


class _WritingEveryLink(BreakMemory):
    """Writes every link of every prompt, as before a conversation's prompt wrote only what it adds."""

    @staticmethod
    def _written(*_: Any) -> int:
        return 0


def test_a_prompt_writes_only_the_links_it_adds_and_explains_as_writing_them_all() -> None:
    """A conversation's history is not written again on every request (its links keep naming the
    prompt that wrote them): every explanation is the one writing every link gives, on conversations
    that grow, regenerate a reply, ask for another answer, edit their history, slide, change their
    tools, and open alike (each request with its conversation's key, as the proxy sends them)."""
    import random

    for seed in range(12):
        rng = random.Random(seed)
        ours, theirs = BreakMemory(), _WritingEveryLink()
        chats: dict[str, list[dict[str, Any]]] = {}
        for step in range(40):
            key = f"c{rng.randrange(3)}"
            messages = chats.setdefault(key, [{"role": "system", "content": SYSTEM}])
            kind = rng.choice(["grow", "grow", "grow", "regenerate", "again", "edit", "slide", "tools", "same"])
            if kind == "regenerate" and len(messages) > 2:
                messages[-1] = assistant(f"another answer {step}")
            elif kind == "again" and len(messages) > 2:
                del messages[-1]  # the same request sent again (another answer asked for)
            elif kind == "edit" and len(messages) > 3:
                messages[rng.randrange(1, len(messages) - 1)] = user(f"edited {step}")
            elif kind == "slide" and len(messages) > 5:
                del messages[1:3]
            if messages[-1]["role"] != "user":
                messages.append(user(f"question {rng.randrange(4)} of {key}"))
            tools = TOOLS if kind == "tools" and rng.random() < 0.5 else None
            results = []
            answer = assistant(f"answer {step} of {key}")
            for memory in (ours, theirs):
                prompt = digest_prompt(body([dict(m) for m in messages], tools))
                result, prompt_id = memory.observe(prompt, key)
                memory.record_reply(prompt_id, *message_hash(answer))
                results.append((result.cause, result.message, result.line, result.lost_bytes, result.expected_bytes))
            assert results[0] == results[1], (seed, step, kind)
            messages.append(answer)
