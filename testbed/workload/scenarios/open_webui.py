"""``open_webui``: Open WebUI with prompt variables in the middle of a system prompt, and its chat id.

Open WebUI fills ``{{CURRENT_DATE}}`` (``%Y-%m-%d``), ``{{CURRENT_TIME}}`` (``%I:%M:%S %p``, to the
second), ``{{CURRENT_WEEKDAY}}``, ``{{USER_NAME}}`` and ``{{USER_LOCATION}}`` wherever the user wrote
them in a model's system prompt; here in the middle of a real instruction (the Python Coding Prompt
of the bundled Dify data), between its paragraphs. With ``ENABLE_FORWARD_USER_INFO_HEADERS`` it sends
``X-OpenWebUI-Chat-Id`` on every request of a chat. Its RAG template (knowledge attached to the
model) wraps the *last* user message with the retrieved context, and earlier turns are replayed as
the user typed them.

The time line differs on every request, the user's line between users: everything after them
misses on every turn, direct. Time is simulated (20 s to 4 min between requests).
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

from testbed.workload.corpus import dify_node
from testbed.workload.registry import Scenario
from testbed.workload.scenarios.common import USER_NAMES_EN, mt_bench_turns, user_turn_count
from testbed.workload.scenarios.dify_rag import retrieve
from testbed.workload.session import Message, Session

NAME = "open_webui"
APP = ("Python Coding Prompt", "llm")
EPOCH = datetime(2026, 11, 30, 8, 0, 0, tzinfo=UTC)
LOCATIONS = ("Lisbon, Portugal", "Osaka, Japan", "Nairobi, Kenya", "Toronto, Canada")
# Written for this workload, in the manner of a RAG template that wraps the user's query.
RAG_TEMPLATE = (
    "Use the context below to answer the user's query. Cite a source by its id when you use it; "
    "if the context does not contain the answer, say so and answer from what you know.\n\n"
    "<context>\n{context}\n</context>\n\n<user_query>\n{query}\n</user_query>"
)


class OpenWebUISession(Session):
    def __init__(self, index: int, rng: random.Random) -> None:
        super().__init__(NAME, index, rng, mt_bench_turns(rng, user_turn_count(rng), index))
        self.user_name = USER_NAMES_EN[index % len(USER_NAMES_EN)]
        self.location = LOCATIONS[index % len(LOCATIONS)]
        self.chat_id = f"{rng.getrandbits(128):032x}"
        self.now = EPOCH + timedelta(seconds=rng.randrange(8 * 3600))
        self.knowledge = index % 2 == 0  # half of the chats use a model with knowledge attached
        head, _, tail = dify_node(*APP).system.partition("\n\n")
        self._head, self._tail = head, tail

    def system_messages(self, query: str) -> list[Message]:
        self.now += timedelta(seconds=self.rng.randint(20, 240))
        variables = (
            f"You are talking to {self.user_name}, who works from {self.location}.\n"
            f"Today is {self.now.strftime('%A')}, {self.now.strftime('%Y-%m-%d')}; "
            f"the local time is {self.now.strftime('%I:%M:%S %p')}."
        )
        return [{"role": "system", "content": f"{self._head}\n\n{variables}\n\n{self._tail}"}]

    def render_history(self) -> list[Message]:
        history = super().render_history()
        if self.knowledge and history and history[-1]["role"] == "user":
            query = str(history[-1]["content"])
            context = "\n".join(f'<source id="{i + 1}">{p}</source>' for i, p in enumerate(retrieve(query, 3)))
            history[-1] = {"role": "user", "content": RAG_TEMPLATE.format(context=context, query=query)}
        return history

    def extra_headers(self) -> dict[str, str]:
        return {"X-OpenWebUI-Chat-Id": self.chat_id}

    def extra_body(self) -> dict[str, Any]:
        return {"user": f"owui-{self.user_name.split()[0].lower()}"}


SCENARIO = Scenario(
    NAME,
    "Open WebUI: date, time and user variables mid-prompt, chat id header, RAG on the last message",
    OpenWebUISession,
)
