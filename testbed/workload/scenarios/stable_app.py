"""(e) ``stable_app``: an application that is already cache friendly.

A fixed system prompt (a real Dify instruction), BFCL's ticket API tools in a fixed order with
fixed key order, and history (tool calls and their ids included) re-sent byte for byte as the
backend produced it. The proxy has nothing to fix here and must not make it worse.
"""

from __future__ import annotations

import random

from testbed.workload.registry import Scenario
from testbed.workload.scenarios.common import ToolAppSession

NAME = "stable_app"
SYSTEM_NODE = ("中译英", "1721105983723")
SUITES = ("ticket_api",)


class StableAppSession(ToolAppSession):
    def __init__(self, index: int, rng: random.Random) -> None:
        super().__init__(NAME, index, rng, SUITES, SYSTEM_NODE, index)


SCENARIO = Scenario(
    NAME,
    "already cache friendly: fixed prompt and tools, history re-sent exactly",
    StableAppSession,
)
