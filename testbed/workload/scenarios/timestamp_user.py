"""(b) ``timestamp_user``: a system prompt that starts with the current time and the user's name.

Chat front-ends fill such variables on every request (Open WebUI's ``{{CURRENT_TIME}}``,
``{{CURRENT_WEEKDAY}}`` and ``{{USER_NAME}}``, Dify's ``{{#sys.timestamp#}}``-style inputs), so
the first line differs every request and the second every user: nothing after them hits,
not even the long stable body, which is a real Dify prompt. Three apps, one per format:

- ISO 8601 to the second: ``2026-11-29T14:03:11+08:00``
- Open WebUI: ``Sunday, 02:03:11 PM``
- Chinese: ``2026年11月29日 14:03``

Time is simulated: each session starts at its own moment and the user takes 20 s to 4 min
between requests. History is re-sent exactly as received.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from testbed.workload.corpus import dify_node
from testbed.workload.registry import Scenario
from testbed.workload.scenarios.common import USER_NAMES_EN, USER_NAMES_ZH, mt_bench_turns, user_turn_count
from testbed.workload.session import Message, Session

NAME = "timestamp_user"
EPOCH = datetime(2026, 11, 29, 8, 0, 0, tzinfo=timezone(timedelta(hours=8)))


def _iso(now: datetime, user: str) -> str:
    return f"Current date and time: {now.isoformat(timespec='seconds')}\nUser: {user}"


def _open_webui(now: datetime, user: str) -> str:
    # Open WebUI: {{CURRENT_WEEKDAY}} = "%A", {{CURRENT_TIME}} = "%I:%M:%S %p", {{USER_NAME}}.
    return f"{now.strftime('%A')}, {now.strftime('%I:%M:%S %p')}\nThe user's name is {user}."


def _chinese(now: datetime, user: str) -> str:
    return f"当前时间：{now.year}年{now.month}月{now.day}日 {now.strftime('%H:%M')}\n用户：{user}"


@dataclass(frozen=True)
class TimestampApp:
    app_name: str
    node_id: str
    header: Callable[[datetime, str], str]
    names: tuple[str, ...]


APPS = (
    TimestampApp("宝玉的英译中优化版", "1722490889313", _iso, USER_NAMES_EN),
    TimestampApp("Python Coding Prompt", "llm", _open_webui, USER_NAMES_EN),
    TimestampApp("根据用户的意图进行回复", "1718246916748", _chinese, USER_NAMES_ZH),
)


class TimestampUserSession(Session):
    def __init__(self, index: int, rng: random.Random) -> None:
        super().__init__(NAME, index, rng, mt_bench_turns(rng, user_turn_count(rng), index // len(APPS)))
        self.app = APPS[index % len(APPS)]
        self.user_name = rng.choice(self.app.names)
        self.now = EPOCH + timedelta(seconds=rng.randrange(3 * 24 * 3600))
        self._body = dify_node(self.app.app_name, self.app.node_id).system

    def system_messages(self, query: str) -> list[Message]:
        self.now += timedelta(seconds=self.rng.randint(20, 240))
        return [{"role": "system", "content": f"{self.app.header(self.now, self.user_name)}\n\n{self._body}"}]


SCENARIO = Scenario(
    NAME,
    "time to the second and the user's name at the top of the system prompt",
    TimestampUserSession,
)
