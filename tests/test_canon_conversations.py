"""A conversation forwarded with its system prompt as sent keeps it as sent, whatever the app's
other prompts teach learned volatility later (qwen-code alternates its main requests with a memory
side request whose system prompt shares most of the main one's lines)."""

from __future__ import annotations

import json
from typing import Any

from proxy.canon.canonicalizer import Canonicalizer
from proxy.config import CanonSettings

SHARED = [f"Rule {n}: keep the change focused and explain what you did in plain words." for n in range(40)]
MAIN_ONLY = [f"Main agent instruction {n}: use the tools to read before you edit." for n in range(30)]
SIDE_ONLY = [f"Memory extraction step {n}: keep only durable facts about the user." for n in range(10)]
MAIN = "\n".join(["You are Qwen Code, an interactive CLI agent.", *SHARED, *MAIN_ONLY])
SIDE = "\n".join(["You are Qwen Code, an interactive CLI agent.", *SHARED[:30], *SIDE_ONLY])


def body(system: str, history: list[dict[str, Any]], tools: int) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, *history],
        "tools": [{"type": "function", "function": {"name": f"tool_{n}", "parameters": {}}} for n in range(tools)],
    }


def dumped(messages: list[dict[str, Any]]) -> list[str]:
    return [json.dumps(m, sort_keys=True) for m in messages]


def test_the_main_conversation_stays_as_sent_between_side_requests() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    history: list[dict[str, Any]] = []
    previous: list[str] = []
    for turn in range(5):
        history.append({"role": "user", "content": f"Step {turn}: fix the failing test in module {turn}."})
        main = canonicalizer.apply(body(MAIN, history, 11), "t")
        assert main.body["messages"][0]["content"] == MAIN, f"turn {turn}: {main.actions}"
        forwarded = dumped(main.body["messages"])
        assert forwarded[: len(previous)] == previous, f"turn {turn} does not extend the one before"
        history.append({"role": "assistant", "content": f"Fixed module {turn}."})
        previous = [*forwarded, json.dumps(history[-1], sort_keys=True)]
        side = [{"role": "user", "content": f"Extract memories from: {history[-2]['content']}"}]
        canonicalizer.apply(body(SIDE, side, 4), "t")
