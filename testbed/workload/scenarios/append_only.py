"""``append_only``: a plain chat, history re-sent exactly, today's date in the middle of its prompt.

Open WebUI fills ``{{CURRENT_DATE}}`` (``%Y-%m-%d``) and ``{{CURRENT_WEEKDAY}}`` wherever the user
wrote them in a system prompt; within a day the value is the same on every request. A date on a
metadata line is what a detector flags, and here it never varies: a direct connection already
reuses every turn's prefix, and the proxy must not cost more (within 2% of direct).
"""

from __future__ import annotations

import random

from testbed.workload.corpus import dify_node
from testbed.workload.registry import Scenario
from testbed.workload.scenarios.common import mt_bench_turns
from testbed.workload.session import Message, Session

NAME = "append_only"
USER_TURNS = 20
# An instruction no other scenario uses: the demo's backends are shared by all scenarios, and another
# scenario warming (or not) the same text would blur this row's comparison with direct.
APP = ("搜索大师3", "1719932888279")
# A fixed day, as one day's traffic sees it (written for this workload).
TODAY = "Today is 2026-11-30 (Monday)."


class AppendOnlySession(Session):
    def __init__(self, index: int, rng: random.Random) -> None:
        super().__init__(NAME, index, rng, mt_bench_turns(rng, USER_TURNS, index))
        instruction = dify_node(*APP).system.rstrip("\n")
        head, _, tail = instruction.partition(". ")
        self._system = f"{head}.\n\n{TODAY}\n\n{tail}" if tail else f"{instruction}\n\n{TODAY}"

    def system_messages(self, query: str) -> list[Message]:
        return [{"role": "system", "content": self._system}]


SCENARIO = Scenario(
    NAME,
    f"plain chat, {USER_TURNS} turns re-sent exactly, a constant date mid-prompt",
    AppendOnlySession,
    max_sessions=8,
)
