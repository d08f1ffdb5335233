"""(f) ``sliding_window``: a chat app whose memory keeps only the last few messages.

Dify's window memory (``memory.window``) and token-buffer memories re-send only the most recent
messages, so the first message of the history changes every turn and everything after the
system prompt misses. The app is a real Dify chatbot node with window memory (记忆测试, a health
assistant; like most window-memory nodes in the data set its system prompt is short, so the history
is most of the prompt); the client keeps a window of 6 messages (the current question included)
over 20 user turns.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from testbed.workload.corpus import dify_node
from testbed.workload.registry import Scenario
from testbed.workload.scenarios.common import mt_bench_turns
from testbed.workload.session import Message, Session

NAME = "sliding_window"
WINDOW_MESSAGES = 6
USER_TURNS = 20
APP = ("记忆测试", "1726714203524")
TOPIC = "饮食控制、按时服药、血压血糖监测、适量运动"


class SlidingWindowSession(Session):
    def __init__(self, index: int, rng: random.Random) -> None:
        # Each patient writes about their own readings, as real users do: no two conversations share
        # a window (with a small question pool they would, and hit each other's cache directly).
        turns = [
            f"{question}\n（我今天的血压是 {rng.randint(105, 165)}/{rng.randint(65, 100)}）"
            for question in mt_bench_turns(rng, USER_TURNS, index)
        ]
        super().__init__(NAME, index, rng, turns)
        self._system = dify_node(*APP).fill_system({"conversation.topic": TOPIC})

    def system_messages(self, query: str) -> list[Message]:
        return [{"role": "system", "content": self._system}]

    def extra_body(self) -> dict[str, Any]:
        # Dify's OpenAI-compatible provider sends the end user's id as ``user``.
        return {"user": f"patient-{self.index:03d}"}

    def render_history(self) -> list[Message]:
        return copy.deepcopy(self.history[-WINDOW_MESSAGES:])


SCENARIO = Scenario(
    NAME,
    f"memory window of {WINDOW_MESSAGES} messages over {USER_TURNS} turns: the history start shifts every turn",
    SlidingWindowSession,
    max_sessions=8,
)
