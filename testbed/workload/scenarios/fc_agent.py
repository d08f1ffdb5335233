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

import random
from typing import Any

from testbed.workload.registry import Scenario
from testbed.workload.scenarios.common import ToolAppSession
from testbed.workload.session import Message, reserialize_arguments, seeded_uuid4, shuffle_keys

NAME = "fc_agent"
SYSTEM_NODE = ("搜索大师3", "1719932888279")
APPS: tuple[tuple[str, ...], ...] = (("message_api",), ("ticket_api",), ("message_api", "ticket_api"))


class FcAgentSession(ToolAppSession):
    def __init__(self, index: int, rng: random.Random) -> None:
        self.suites = APPS[index % len(APPS)]
        super().__init__(NAME, index, rng, self.suites, SYSTEM_NODE, index // len(APPS))

    def tools_for_request(self) -> list[dict[str, Any]]:
        tools = super().tools_for_request()
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


SCENARIO = Scenario(
    NAME,
    "function-calling agent: shuffled tools and keys, fresh tool-call ids, re-serialized arguments",
    FcAgentSession,
)
