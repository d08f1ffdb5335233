"""(e) ``stable_app``: an application that is already cache friendly.

A fixed system prompt (a real Dify instruction), BFCL's ticket API tools in a fixed order with
fixed key order, and history (tool calls and their ids included) re-sent byte for byte as the
backend produced it. The proxy has nothing to fix here and must not make it worse.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from proxy.workload.corpus import dify_node, tool_suite
from proxy.workload.registry import Scenario
from proxy.workload.scenarios.common import tool_result, tool_tasks, user_turn_count
from proxy.workload.session import Message, Session

NAME = "stable_app"
SYSTEM_NODE = ("中译英", "1721105983723")
SUITES = ("ticket_api",)


class StableAppSession(Session):
    def __init__(self, index: int, rng: random.Random) -> None:
        super().__init__(NAME, index, rng, tool_tasks(rng, SUITES, user_turn_count(rng), index))
        self._system = dify_node(*SYSTEM_NODE).system
        self._tools = [tool for suite in SUITES for tool in tool_suite(suite)]

    @property
    def uses_tools(self) -> bool:
        return True

    def system_messages(self, query: str) -> list[Message]:
        return [{"role": "system", "content": self._system}]

    def tools_for_request(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self._tools)

    def tool_result(self, name: str, arguments: dict[str, Any]) -> str:
        return tool_result(name, arguments, self.rng)


SCENARIO = Scenario(
    NAME,
    "already cache friendly: fixed prompt and tools, history re-sent exactly",
    StableAppSession,
)
