"""(c) ``fc_agent``: a function-calling agent that rebuilds its request from scratch every time.

Modelled on Dify's ``fc_agent_runner``: the agent loop is user -> assistant tool call ->
tool result -> assistant answer, and on every request the client

- sends its 8-20 BFCL tools in a new order, every JSON object's keys shuffled (what a
  client that keeps tools in a set or a dict of unordered origin ends up sending);
- rebuilds history tool calls with FRESH uuid4 ids (tool results carry the matching fresh
  ids) and re-serialized arguments (other separators, other key order).

The system prompt is a real, stable Dify instruction; the apps are BFCL's message API (10
tools), ticket API (9) and both (19). User requests are written for this workload.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from proxy.workload.corpus import dify_node, tool_suite
from proxy.workload.registry import Scenario
from proxy.workload.scenarios.common import tool_result, tool_tasks, user_turn_count
from proxy.workload.session import Message, Session, reserialize_arguments, seeded_uuid4, shuffle_keys

NAME = "fc_agent"
SYSTEM_NODE = ("搜索大师3", "1719932888279")
APPS: tuple[tuple[str, ...], ...] = (("message_api",), ("ticket_api",), ("message_api", "ticket_api"))


class FcAgentSession(Session):
    def __init__(self, index: int, rng: random.Random) -> None:
        self.suites = APPS[index % len(APPS)]
        super().__init__(NAME, index, rng, tool_tasks(rng, self.suites, user_turn_count(rng), index // len(APPS)))
        self._system = dify_node(*SYSTEM_NODE).system
        self._tools = [tool for suite in self.suites for tool in tool_suite(suite)]

    @property
    def uses_tools(self) -> bool:
        return True

    def system_messages(self, query: str) -> list[Message]:
        return [{"role": "system", "content": self._system}]

    def tools_for_request(self) -> list[dict[str, Any]]:
        tools = copy.deepcopy(self._tools)
        self.rng.shuffle(tools)
        shuffled: list[dict[str, Any]] = shuffle_keys(tools, self.rng)
        return shuffled

    def render_history(self) -> list[Message]:
        fresh_ids: dict[Any, str] = {}
        out: list[Message] = []
        for message in self.history:
            if message["role"] == "assistant" and message.get("tool_calls"):
                calls = []
                for call in message["tool_calls"]:
                    fresh = seeded_uuid4(self.rng)
                    fresh_ids[call["id"]] = fresh
                    function = call["function"]
                    arguments = reserialize_arguments(function["arguments"], self.rng)
                    calls.append(
                        {
                            "id": fresh,
                            "type": "function",
                            "function": {"name": function["name"], "arguments": arguments},
                        }
                    )
                out.append({"role": "assistant", "content": message.get("content") or "", "tool_calls": calls})
            elif message["role"] == "tool":
                out.append({**message, "tool_call_id": fresh_ids.get(message["tool_call_id"], seeded_uuid4(self.rng))})
            else:
                out.append(dict(message))
        return out

    def tool_result(self, name: str, arguments: dict[str, Any]) -> str:
        return tool_result(name, arguments, self.rng)


SCENARIO = Scenario(
    NAME,
    "function-calling agent: shuffled tools and keys, fresh tool-call ids, re-serialized arguments",
    FcAgentSession,
)
