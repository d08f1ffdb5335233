"""(g) ``long_session``: one long conversation that outgrows a comfortable context.

40 user turns, each a question with a passage the user pastes in (as people do with documents and
logs), history re-sent in full, so the context passes 12k tokens. Without help it keeps growing
toward the model's limit; the proxy's summarizer folds old turns into a summary that stays stable
between compactions.
"""

from __future__ import annotations

import random

from testbed.workload.corpus import dify_node, knowledge_passages
from testbed.workload.registry import Scenario
from testbed.workload.scenarios.common import mt_bench_turns
from testbed.workload.session import Message, Session

NAME = "long_session"
USER_TURNS = 40
PASSAGES_PER_TURN = 4
APP = ("宝玉的英译中优化版", "1722490889313")


class LongSession(Session):
    def __init__(self, index: int, rng: random.Random) -> None:
        passages = knowledge_passages()
        turns = []
        for question in mt_bench_turns(rng, USER_TURNS, index):
            pasted = "\n\n".join(rng.choice(passages) for _ in range(PASSAGES_PER_TURN))
            turns.append(f"{question}\n\nHere is the material I am working from:\n{pasted}")
        super().__init__(NAME, index, rng, turns)
        self._system = dify_node(*APP).system

    def system_messages(self, query: str) -> list[Message]:
        return [{"role": "system", "content": self._system}]


SCENARIO = Scenario(
    NAME,
    f"{USER_TURNS} turns with pasted material, full history: context past 12k tokens",
    LongSession,
    max_sessions=4,
)
