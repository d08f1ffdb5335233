"""``responses_agent``: an operations agent on ``/v1/responses`` (the Agents SDK's way).

Modelled on an OpenAI Agents SDK app (texts written for this workload): long, fixed instructions
that end with the current date and time (dynamic instructions, computed when the agent runs:
the same for every request of one user turn, another one for the next), 10 function tools, the
whole conversation re-sent as input items every request (``store: false``): user messages,
``function_call`` items as the backend produced them, ``function_call_output`` items with
sizeable JSON results, assistant messages.

Direct, every user turn misses from the time line on (the tools and the history are rendered
after it); through the proxy the line moves before the newest user message.
"""

from __future__ import annotations

import json
import random
from typing import Any

from testbed.workload.registry import Scenario
from testbed.workload.session import Message, Session

NAME = "responses_agent"

INSTRUCTIONS = """You are the on-call operations assistant of an online shop's platform team. You help \
engineers investigate incidents, understand the state of services and carry out routine operations.

How you work:
- Ground every statement in data you fetched with your tools in this conversation; say so when you could not.
- Prefer read-only tools. Before anything that changes production (restarts, rollbacks, paging someone), \
state what you are about to do and why, then do it only if the engineer asked for that kind of action.
- When metrics and logs disagree, report both and say which you trust more and why.
- Keep answers short: the finding first, then the evidence as a compact list, then the next step you suggest.
- Times are in UTC. Quote service names exactly as the tools return them.

Services you know: checkout, payments, inventory, search, recommendations, notifications, auth, \
api-gateway. Each has an owner team, a runbook and an error budget; the tools give you access to all of it.

Escalation policy: page the owning team when an error budget burns faster than 10x for more than \
15 minutes, or when customers cannot pay. Never page for warnings alone."""

TASKS = (
    "Checkout latency looks high since this morning. What is going on?",
    "Are there any open incidents for payments right now?",
    "Show me the error rate of the search service over the last hour.",
    "Which deploys went out today, and did any of them correlate with errors?",
    "The notifications service keeps restarting. Find out why.",
    "Who owns the inventory service and what does its runbook say about stock drift?",
    "Is the auth service within its error budget this week?",
    "Look for timeout errors in the api-gateway logs from the last 30 minutes.",
)


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "name": name, "description": description, "parameters": parameters, "strict": True}


_SERVICE = {"type": "string", "description": "Service name, as the tools list it"}
_WINDOW = {"type": "string", "description": "Time window, e.g. 1h or 30m"}

TOOLS: list[dict[str, Any]] = [
    _function("get_metrics", "Latency percentiles, error rate and throughput of a service over a window.",
              {"service": _SERVICE, "window": _WINDOW}, ["service", "window"]),
    _function("query_logs", "Searches a service's logs for a pattern within a window; returns the newest matches.",
              {"service": _SERVICE, "pattern": {"type": "string"}, "window": _WINDOW},
              ["service", "pattern", "window"]),
    _function("list_incidents", "Open and recently closed incidents, optionally for one service.",
              {"service": _SERVICE, "status": {"type": "string", "enum": ["open", "closed", "all"]}}, ["status"]),
    _function("get_deploys", "Deploys of a service (or all services) since a time, with commit and author.",
              {"service": _SERVICE, "since": {"type": "string"}}, ["since"]),
    _function("get_error_budget", "Error budget consumption and burn rate of a service for the current week.",
              {"service": _SERVICE}, ["service"]),
    _function("get_service_owner", "The owning team, its on-call engineer and its chat channel.",
              {"service": _SERVICE}, ["service"]),
    _function("search_runbooks", "Full-text search over the runbooks; returns matching sections.",
              {"query": {"type": "string"}, "service": _SERVICE}, ["query"]),
    _function("restart_service", "Rolling restart of a service's pods. Changes production.",
              {"service": _SERVICE, "reason": {"type": "string"}}, ["service", "reason"]),
    _function("rollback_deploy", "Rolls a service back to its previous deploy. Changes production.",
              {"service": _SERVICE, "deploy_id": {"type": "string"}}, ["service", "deploy_id"]),
    _function("page_oncall", "Pages the on-call engineer of a team with a message.",
              {"team": {"type": "string"}, "message": {"type": "string"}}, ["team", "message"]),
]  # fmt: skip


class ResponsesAgentSession(Session):
    protocol = "responses"

    def __init__(self, index: int, rng: random.Random) -> None:
        tasks = list(TASKS)
        first = tasks.pop(index % len(tasks))
        rng.shuffle(tasks)
        super().__init__(NAME, index, rng, [first, *tasks[: rng.randint(2, 4)]])
        self._start_minutes = 9 * 60 + index * 7

    @property
    def uses_tools(self) -> bool:
        return True

    def tool_result(self, name: str, arguments: dict[str, Any]) -> str:
        rows = [
            {
                "ts": f"2025-06-12T{10 + n // 60:02d}:{n % 60:02d}:00Z",
                "service": arguments.get("service", "checkout"),
                "p50_ms": self.rng.randint(40, 90),
                "p99_ms": self.rng.randint(300, 2400),
                "error_rate": round(self.rng.random() / 20, 4),
                "rps": self.rng.randint(200, 900),
            }
            for n in range(0, 60, 3)
        ]
        return json.dumps({"tool": name, "rows": rows})

    def _now(self) -> str:
        minutes = self._start_minutes + 4 * min(self._turn, len(self.user_turns) - 1)
        return f"2025-06-12 {minutes // 60:02d}:{minutes % 60:02d} UTC"

    def next_request(self) -> dict[str, Any] | None:
        chat = super().next_request()
        if chat is None:
            return None
        return {
            "instructions": f"{INSTRUCTIONS}\n\nCurrent date and time: {self._now()}",
            "input": to_input_items(chat["messages"]),
            "tools": TOOLS,
            "store": False,
        }


def to_input_items(messages: list[Message]) -> list[dict[str, Any]]:
    """Chat history as the Agents SDK re-sends it: input items."""
    items: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "user":
            items.append({"role": "user", "content": message["content"]})
        elif role == "assistant":
            if message.get("content"):
                items.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": message["content"]}],
                    }
                )
            for call in message.get("tool_calls") or []:
                function = call["function"]
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": function["name"],
                        "arguments": function["arguments"],
                    }
                )
        elif role == "tool":
            items.append(
                {"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}
            )
    return items


SCENARIO = Scenario(
    NAME,
    "agent on /v1/responses: fixed instructions ending with the current time, 10 tools, full input re-sent",
    ResponsesAgentSession,
)
