"""``constant_context``: a Dify knowledge-base chatbot whose retrieval finds nothing, on a long chat.

Dify keeps its context prompt in the system message when the knowledge base returns no chunk, so
every request carries the same empty wrapper (``<context>`` and ``</context>`` around nothing) at
the top: something a detector flags, that never varies. 40 user turns, history re-sent exactly
(append-only). Nothing varies, so the proxy must forward what the client sent where it put it;
its computed prefill must stay within 2% of a direct connection's.
"""

from __future__ import annotations

import random

from testbed.workload.corpus import dify_node, fill_placeholders
from testbed.workload.registry import Scenario
from testbed.workload.scenarios.common import mt_bench_turns
from testbed.workload.session import Message, Session

NAME = "constant_context"
USER_TURNS = 40
CONTEXT_NODE = ("document chat", "1720801890321")
INSTRUCTION_NODE = ("根据用户的意图进行回复", "1718246916748")


class ConstantContextSession(Session):
    def __init__(self, index: int, rng: random.Random) -> None:
        super().__init__(NAME, index, rng, mt_bench_turns(rng, USER_TURNS, index))
        context_prompt = fill_placeholders(dify_node(*CONTEXT_NODE).system, {"context": ""})
        self._system = f"{context_prompt}\n\n{dify_node(*INSTRUCTION_NODE).system}"

    def system_messages(self, query: str) -> list[Message]:
        return [{"role": "system", "content": self._system}]


SCENARIO = Scenario(
    NAME,
    f"Dify context wrapper present but empty on every request, {USER_TURNS} append-only turns",
    ConstantContextSession,
    max_sessions=3,
)
