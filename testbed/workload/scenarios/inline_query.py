"""(d) ``inline_query``: a real Dify system prompt that inlines the user's current question.

Dify fills ``{{#sys.query#}}`` inside the system prompt, so the current question sits near
the top (``## 问题\\n\"\"\"{{#sys.query#}}\"\"\"`` before the instruction body of the llm→o1
app's "执行任务" node, or ``给你topic：{{#sys.query#}}`` in the third line of 瞎说新语v2's
chatflow node) and everything after it misses on every turn. The user message is the
question again (Dify's default query template), history is re-sent exactly, and the other
placeholders of the prompt get fixed values (one step of the llm→o1 workflow).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from testbed.workload.corpus import dify_node
from testbed.workload.registry import Scenario
from testbed.workload.scenarios.common import mt_bench_turns, user_turn_count
from testbed.workload.session import Message, Session

NAME = "inline_query"


@dataclass(frozen=True)
class InlineApp:
    app_name: str
    node_id: str
    fills: dict[str, str] = field(default_factory=dict)


APPS = (
    InlineApp(
        "llm→o1",
        "1727189055973",
        {
            "1727189052583.name": "步骤一：理解问题",
            "1727189052583.content": (
                "梳理问题中给出的已知条件、约束和最终要回答的目标，说明解决它需要用到哪些知识和方法，"
                "并指出问题中可能存在的歧义或隐含假设。"
            ),
        },
    ),
    InlineApp("瞎说新语v2", "llm"),
)


class InlineQuerySession(Session):
    def __init__(self, index: int, rng: random.Random) -> None:
        super().__init__(NAME, index, rng, mt_bench_turns(rng, user_turn_count(rng), index // len(APPS)))
        self.app = APPS[index % len(APPS)]
        self._node = dify_node(self.app.app_name, self.app.node_id)

    def system_messages(self, query: str) -> list[Message]:
        return [{"role": "system", "content": self._node.fill_system({**self.app.fills, "sys.query": query})}]


SCENARIO = Scenario(
    NAME,
    "Dify prompt with the current question {{#sys.query#}} inlined near the top",
    InlineQuerySession,
)
