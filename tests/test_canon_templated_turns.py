"""A one-shot request whose user turn is a template (a task instruction around data, as a chat app's
title or follow-up task or a workflow's LLM node sends) gets the system prompt's changing lines after
that turn once the app has sent the template before: the instruction's KV is then shared by every
such request. A person's question, and any turn of a conversation, keeps them before the question."""

from __future__ import annotations

from typing import Any

from proxy.canon.canonicalizer import Canonicalizer
from proxy.config import CanonSettings
from proxy.enginemodel.chat_template import render_chat
from proxy.enginemodel.prefix_cache import PrefixCache
from proxy.enginemodel.tokenizer import TiktokenChatTokenizer

SYSTEM = (
    "You are Bench Assistant, a concise helper for a small team.\n"
    "Answer in one or two sentences and say so when you are unsure.\n"
    "Today's date is 2026-12-02 and the local time is {clock}.\n"
    "Prefer plain language and use lists only when asked."
)
TASK = (
    "### Task:\nSuggest 3-5 relevant follow-up questions or prompts that the user might naturally ask next "
    "in this conversation as a **user**, based on the chat history, to help continue or deepen the "
    "discussion.\n### Guidelines:\n- Write all follow-up questions from the user's point of view, directed "
    "to the assistant.\n- Make questions concise, clear, and directly related to the discussed topic(s).\n"
    '### Output:\nJSON format: { "follow_ups": ["Question 1?", "Question 2?"] }\n'
    "### Chat History:\n<chat_history>\n{history}\n</chat_history>"
)


def one_shot(clock: str, user: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": SYSTEM.format(clock=clock)}, user_turn(user)]}


def user_turn(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def clocks(n: int, start: int = 0) -> list[str]:
    return [f"17:{40 + k // 60:02d}:{k % 60:02d}" for k in range(start, start + n)]


def test_a_templated_one_shot_gets_the_changing_lines_after_its_template() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    forwarded = []
    for number, clock in enumerate(clocks(4)):
        history = f"USER: question {number} about the garden\nASSISTANT: answer {number}"
        result = canonicalizer.apply(one_shot(clock, TASK.replace("{history}", history)), "t")
        forwarded.append(result.body["messages"])
    # The first is decided before the template is known; from the second on the template comes first.
    for messages in forwarded[2:]:
        roles = [m["role"] for m in messages]
        assert roles == ["system", "user", "system"], roles
        assert messages[1]["content"].startswith("### Task:")
    # Nothing is lost or reworded: the same lines, the time line as sent.
    for clock, messages in zip(clocks(4)[2:], forwarded[2:], strict=True):
        assert messages[2]["content"] == f"Today's date is 2026-12-02 and the local time is {clock}."
        kept = [line for line in SYSTEM.format(clock=clock).splitlines() if line != messages[2]["content"]]
        assert messages[0]["content"] == "\n".join(kept)


def test_the_template_is_shared_by_the_backend_from_the_second_request_on() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    tokenizer = TiktokenChatTokenizer()
    cache = PrefixCache(block_size=16)
    computed = []
    for number, clock in enumerate(clocks(6)):
        history = f"USER: question {number} about the garden\nASSISTANT: answer {number}"
        result = canonicalizer.apply(one_shot(clock, TASK.replace("{history}", history)), "t")
        blocks = cache.admit(tokenizer.encode(render_chat(result.body["messages"])))
        assert blocks is not None
        computed.append(blocks.num_prompt_tokens - blocks.num_cached_tokens)
        cache.finish(blocks, [])
    template_tokens = len(tokenizer.encode(TASK.split("{history}")[0]))
    # The first keeps its lines (not seen to vary yet), the second moves them before the template (not
    # known yet), the third after it; from the fourth on the template is cached.
    assert all(c < template_tokens for c in computed[3:]), (computed, template_tokens)
    assert sum(computed[3:]) < sum(computed[:3]) / 2


def test_a_question_and_a_conversation_keep_the_lines_before_the_question() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    for clock in clocks(3):
        # A short question that repeats (a person asking the same thing again) is no template.
        result = canonicalizer.apply(one_shot(clock, "What should I plant in December?"), "t")
    assert [m["role"] for m in result.body["messages"]] == ["system", "system", "user"]
    long_question = "Here is my garden plan, tell me what is wrong with it. " * 8
    for clock in clocks(3, start=10):
        body = one_shot(clock, long_question)
        body["messages"][1:1] = [user_turn("hello"), {"role": "assistant", "content": "Hello! How can I help?"}]
        result = canonicalizer.apply(body, "t")
        # A turn of a conversation: the lines go before its last question, as configured.
        assert [m["role"] for m in result.body["messages"]][-2:] == ["system", "user"]
