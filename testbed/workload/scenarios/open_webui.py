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

After each answer Open WebUI runs its background tasks with the chat's id and the model's system
prompt (``backend/open_webui/utils/task.py`` templates: a title after the first answer, tags, and
follow-up suggestions after every answer): one user message holding a task instruction and the chat
so far as ``<chat_history>`` text, no tools. They share the chat's session but are no turn of it. Half
of the chats have tools enabled (native function calling), and the set grows mid-chat, as it does
when the user enables another tool server (4 more tools from the third turn on).
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

from testbed.workload.corpus import dify_node, tool_suite
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


# Open WebUI's default task prompts (DEFAULT_TITLE_GENERATION_PROMPT_TEMPLATE and its siblings in
# backend/open_webui/config.py), abridged to their instruction and output format.
TASKS = {
    "title": (
        "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.\n"
        "### Guidelines:\n- The title should clearly represent the main theme or subject of the conversation.\n"
        "- Use emojis that enhance understanding of the topic, but avoid quotation marks or special formatting.\n"
        "- Write the title in the chat's primary language; default to English if multilingual.\n"
        '### Output:\nJSON format: { "title": "your concise title here" }\n'
    ),
    "tags": (
        "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat history, along with 1-3 "
        "more specific subtopic tags.\n### Guidelines:\n- Start with high-level domains (e.g. Science, "
        "Technology, Philosophy, Arts, Politics, Business, Health, Sports, Entertainment, Education)\n"
        "- Consider including relevant subfields/subdomains if they are strongly represented throughout "
        'the conversation\n### Output:\nJSON format: { "tags": ["tag1", "tag2", "tag3"] }\n'
    ),
    "follow_ups": (
        "### Task:\nSuggest 3-5 relevant follow-up questions or prompts that the user might naturally ask next "
        "in this conversation as a **user**, based on the chat history, to help continue or deepen the "
        "discussion.\n### Guidelines:\n- Write all follow-up questions from the user's point of view, "
        "directed to the assistant.\n- Make questions concise, clear, and directly related to the discussed "
        'topic(s).\n### Output:\nJSON format: { "follow_ups": ["Question 1?", "Question 2?"] }\n'
    ),
}
TOOLS_FROM_TURN = 2  # the turn (0-based) from which the grown tool set is sent


def chat_history_text(history: list[Message]) -> str:
    """The chat as Open WebUI's task templates embed it (``{{MESSAGES:END:6}}``)."""
    lines = [
        f"{m['role'].upper()}: {m.get('content') or ''}" for m in history[-6:] if m["role"] in ("user", "assistant")
    ]
    return "<chat_history>\n" + "\n".join(lines) + "\n</chat_history>"


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
        self._tools = tool_suite("message_api") if index % 4 in (1, 3) else None
        self._more_tools = tool_suite("ticket_api")[:4]
        self._tasks: list[str] = []
        self._task_pending = False

    @property
    def done(self) -> bool:
        return super().done and not self._tasks

    @property
    def expected_requests(self) -> int:
        turns = len(self.user_turns)
        return turns + 2 + turns  # a request per turn, a title and tags, follow-ups after every answer

    def tools_for_request(self) -> list[dict[str, Any]] | None:
        if self._tools is None:
            return None
        return [*self._tools, *self._more_tools] if self._turn >= TOOLS_FROM_TURN else list(self._tools)

    def next_request(self) -> dict[str, Any] | None:
        if self._tasks and not self._awaiting:
            task = self._tasks.pop(0)
            instruction = f"{TASKS[task]}{chat_history_text(self.history)}"
            self._awaiting = self._task_pending = True
            self.requests_sent += 1
            messages = [*self.system_messages(self.current_query), {"role": "user", "content": instruction}]
            return {"messages": messages, **self.extra_body()}
        return super().next_request()

    def observe(self, message: dict[str, Any]) -> None:
        if self._task_pending:
            self._task_pending = self._awaiting = False
            return  # a task's answer goes into the chat's metadata, not its history
        turn = self._turn
        super().observe(message)
        if self._turn > turn:  # the turn was answered: the background tasks run
            self._tasks = ["title", "tags", "follow_ups"] if turn == 0 else ["follow_ups"]

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
