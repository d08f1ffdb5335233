"""Pieces several scenarios share: user turns, user names, tool tasks and tool results."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

from testbed.workload.corpus import Question, dify_node, questions, tool_suite
from testbed.workload.session import Message, Session

MIN_USER_TURNS = 3
MAX_USER_TURNS = 6


def user_turn_count(rng: random.Random) -> int:
    return rng.randint(MIN_USER_TURNS, MAX_USER_TURNS)


def mt_bench_turns(rng: random.Random, count: int, first: int) -> list[str]:
    """``count`` user turns: MT-bench questions, both turns of each, in order.

    The second turn of an MT-bench question refers back to the first answer, so the two
    stay together; then the conversation moves on to another question. ``first`` picks the
    opening question (category ``first % 8``, then the next question of it for every round),
    so sessions of one app given different ``first`` values open differently: real users do
    not replay each other's conversations. The other questions are drawn with ``rng``.
    """
    by_category: dict[str, list[Question]] = {}
    for question in questions():
        by_category.setdefault(question.category, []).append(question)
    categories = list(by_category)
    in_category = by_category[categories[first % len(categories)]]
    opening = in_category[(first // len(categories)) % len(in_category)]
    pool = [q for q in questions() if q is not opening]
    rng.shuffle(pool)
    turns = [turn for question in [opening, *pool] for turn in question.turns]
    return turns[:count]


# Written for this workload (not from the bundled data sets): end users of a workspace app.
USER_NAMES_EN = (
    "Alice Chen",
    "Bob Martinez",
    "Priya Nair",
    "Jonas Weber",
    "Maria Rossi",
    "Kenji Sato",
    "Fatima Khan",
    "Liam O'Brien",
)
USER_NAMES_ZH = ("张伟", "王芳", "李娜", "刘洋", "陈静", "杨磊", "赵敏", "黄涛")

# Requests an end user types into a BFCL-style agent, per tool suite (written for this workload).
TOOL_TASKS: dict[str, tuple[str, ...]] = {
    "message_api": (
        "Add my colleague Maya to my contacts, please.",
        "Send a message to USR003 saying the design review moved to Thursday at 10.",
        "What's my user ID? My user name is Alice.",
        "Show me all the messages I've sent so far.",
        "Search my messages for anything about the quarterly budget.",
        "Delete the last message I sent to USR002, it went to the wrong person.",
        "How many messages have I received? Give me my message stats.",
        "List everyone in the workspace.",
        "Am I currently logged in to the messaging app?",
        "Log me in to the messaging app with user ID USR001.",
    ),
    "ticket_api": (
        "Open a ticket titled 'VPN disconnects every 10 minutes' with priority 4.",
        "What's the status of ticket 7423?",
        "Close ticket 1045, the issue went away on its own.",
        "Resolve ticket 2210 with the note 'Replaced the faulty docking station'.",
        "Change the priority of ticket 3318 to 5 and add that it affects the whole team.",
        "Show me all my open tickets.",
        "Log me in to the ticket system as jdoe.",
        "Am I logged in to the ticket system?",
        "Log me out of the ticket system.",
        "Create a ticket: the printer on floor 3 is jammed again.",
    ),
}


def tool_tasks(rng: random.Random, suites: tuple[str, ...], count: int, first: int) -> list[str]:
    """``count`` different requests for an agent with these suites; the first is ``pool[first]``."""
    pool = [task for suite in suites for task in TOOL_TASKS[suite]]
    opening = pool.pop(first % len(pool))
    return [opening, *rng.sample(pool, min(count, len(pool) + 1) - 1)]


def tool_result(name: str, arguments: dict[str, Any], rng: random.Random) -> str:
    """A plausible JSON result for a BFCL message / ticket API call."""
    if name == "get_user_id":
        result: dict[str, Any] = {"user_id": f"USR{rng.randint(1, 999):03d}"}
    elif name == "list_users":
        result = {"user_list": sorted(rng.sample(USER_NAMES_EN, 4))}
    elif name in ("message_get_login_status", "ticket_get_login_status"):
        result = {"login_status": True}
    elif name == "get_message_stats":
        result = {"stats": {"received_count": rng.randint(0, 40), "total_contacts": rng.randint(1, 12)}}
    elif name in ("view_messages_sent", "search_messages"):
        result = {"messages": [{"receiver_id": "USR002", "message": "See you at the review tomorrow."}]}
    elif name == "send_message":
        result = {"sent_status": True, "message_id": {"new_id": rng.randint(10000, 99999)}}
    elif name in ("create_ticket", "get_ticket", "edit_ticket"):
        result = {
            "id": arguments.get("ticket_id", rng.randint(1000, 9999)),
            "title": arguments.get("title", "Laptop does not boot"),
            "status": "Open",
            "priority": arguments.get("priority", 3),
            "created_by": "jdoe",
        }
    elif name == "get_user_tickets":
        result = {"tickets": [{"id": rng.randint(1000, 9999), "title": "VPN issue", "status": "Open"}]}
    else:
        result = {"status": "success"}
    return json.dumps(result, ensure_ascii=False)


class ToolAppSession(Session):
    """A function-calling app: a fixed Dify system prompt, BFCL tool suites, tool-task turns.

    Sent exactly as held; a scenario that breaks the cache overrides what it re-sends.
    """

    def __init__(
        self,
        name: str,
        index: int,
        rng: random.Random,
        suites: tuple[str, ...],
        system_node: tuple[str, str],
        first_task: int,
    ) -> None:
        super().__init__(name, index, rng, tool_tasks(rng, suites, user_turn_count(rng), first_task))
        self._system = dify_node(*system_node).system
        self._tools = [tool for suite in suites for tool in tool_suite(suite)]

    @property
    def uses_tools(self) -> bool:
        return True

    def system_messages(self, query: str) -> list[Message]:
        return [{"role": "system", "content": self._system}]

    def tools_for_request(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self._tools)

    def tool_result(self, name: str, arguments: dict[str, Any]) -> str:
        return tool_result(name, arguments, self.rng)
