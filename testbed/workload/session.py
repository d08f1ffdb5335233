"""One simulated client conversation: what it sends next, and what it does with a reply.

A session is a small state machine driven by the runner::

    body = session.next_request()       # None once the conversation is over
    session.observe(reply_message)      # choices[0].message of the backend's response

Assistant replies are the backend's own, so the conversation a client re-sends is the one
the backend generated. Each user turn either gets a text answer, or (when the request has
tools) a tool call; the session then appends the tool results and asks again, like an
agent loop, until a text answer comes (at most ``max_tool_rounds`` calls per turn).

What a scenario controls is how the client *builds* each request from its history: the
system prompt (``system_messages``), the tool list (``tools_for_request``) and how history
is re-serialized (``render_history``). The default re-sends everything exactly as received.
All randomness comes from the session's own ``random.Random``, so a session's requests
depend only on the seed and on the replies it got, never on how sessions interleave.
"""

from __future__ import annotations

import copy
import json
import random
import uuid
from typing import Any

Message = dict[str, Any]


class Session:
    """Base class of every scenario's sessions."""

    #: tool-call rounds allowed per user turn before the client stops looping
    max_tool_rounds = 3
    #: what the session's requests are (``testbed.workload.wire``): chat, messages or responses
    protocol = "chat"

    def __init__(self, scenario: str, index: int, rng: random.Random, user_turns: list[str]) -> None:
        if not user_turns:
            raise ValueError("a session needs at least one user turn")
        self.scenario = scenario
        self.index = index
        self.session_id = f"{scenario}-{index:03d}"
        self.rng = rng
        self.user_turns = list(user_turns)
        self.history: list[Message] = []
        self.requests_sent = 0
        self.failed = False
        self._turn = 0
        self._in_turn = False
        self._tool_rounds = 0
        self._awaiting = False

    # -- what scenarios override ------------------------------------------------------------

    def system_messages(self, query: str) -> list[Message]:
        """The leading system message(s) of the next request; ``query`` is the current user turn."""
        return []

    def tools_for_request(self) -> list[dict[str, Any]] | None:
        """The ``tools`` field of the next request (None: no tools)."""
        return None

    def render_history(self) -> list[Message]:
        """The conversation so far as this client re-sends it (default: exactly as received)."""
        return copy.deepcopy(self.history)

    def tool_result(self, name: str, arguments: dict[str, Any]) -> str:
        """The content of the tool message answering a call (computed once, then re-sent)."""
        return json.dumps({"status": "success"})

    def extra_body(self) -> dict[str, Any]:
        """Other request fields a client sets (temperature, user, ...)."""
        return {}

    def extra_headers(self) -> dict[str, str]:
        """HTTP headers a client sets on every request of the conversation (a chat id, ...)."""
        return {}

    # -- the state machine -----------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.failed or self._turn >= len(self.user_turns)

    @property
    def uses_tools(self) -> bool:
        return False

    @property
    def expected_requests(self) -> int:
        """Requests a full run of this session takes when every tool turn needs one tool call."""
        return len(self.user_turns) * (2 if self.uses_tools else 1)

    @property
    def current_query(self) -> str:
        return self.user_turns[min(self._turn, len(self.user_turns) - 1)]

    def next_request(self) -> dict[str, Any] | None:
        """The next chat-completions body (without ``model``), or None when the session is over."""
        if self.done:
            return None
        if self._awaiting:
            raise RuntimeError("observe() the reply to the previous request first")
        if not self._in_turn:
            self.history.append({"role": "user", "content": self.current_query})
            self._in_turn = True
            self._tool_rounds = 0
        messages = self.system_messages(self.current_query) + self.render_history()
        body: dict[str, Any] = {"messages": messages}
        tools = self.tools_for_request()
        if tools is not None:
            body["tools"] = tools
        body.update(self.extra_body())
        self._awaiting = True
        self.requests_sent += 1
        return body

    def observe(self, message: dict[str, Any]) -> None:
        """Take the assistant message the backend answered the last request with."""
        if not self._awaiting:
            raise RuntimeError("no request is waiting for a reply")
        self._awaiting = False
        calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
        reply: Message = {"role": "assistant", "content": message.get("content")}
        if calls:
            reply["tool_calls"] = [_keep_call_fields(c) for c in calls]
        self.history.append(reply)
        if calls and self._tool_rounds < self.max_tool_rounds:
            self._tool_rounds += 1
            for call in reply["tool_calls"]:
                function = call.get("function") or {}
                arguments = _parse_arguments(function.get("arguments"))
                self.history.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.get("id"),
                        "content": self.tool_result(str(function.get("name", "")), arguments),
                    }
                )
            return
        self._in_turn = False
        self._turn += 1

    def on_answer(self, payload: Any) -> None:
        """The whole answer to the last request (before :meth:`observe`), for protocols whose
        answers the client refers to later (a Responses id)."""

    def fail(self) -> None:
        """The last request failed: the client gives up on this conversation."""
        self._awaiting = False
        self.failed = True


def _keep_call_fields(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    return {
        "id": call.get("id"),
        "type": call.get("type", "function"),
        "function": {"name": function.get("name"), "arguments": function.get("arguments")},
    }


def _parse_arguments(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}
    return {}


# -- helpers scenarios share ----------------------------------------------------------------


def seeded_uuid4(rng: random.Random) -> str:
    """A uuid4 string from ``rng`` (what ``uuid.uuid4()`` gives a real client, reproducibly)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def shuffle_keys(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in a random order (list order kept)."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {key: shuffle_keys(value[key], rng) for key in keys}
    if isinstance(value, list):
        return [shuffle_keys(item, rng) for item in value]
    return value


def reserialize_arguments(arguments: Any, rng: random.Random) -> str:
    """Tool-call arguments re-serialized the way one of many client code paths would."""
    value = _parse_arguments(arguments)
    style = rng.randrange(5)
    if style == 0:
        return json.dumps(value)  # Python default: ", " / ": " and ASCII escapes
    if style == 1:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # JS JSON.stringify
    if style == 2:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)  # a dict sorted on the way
    if style == 3:
        return json.dumps(dict(reversed(list(value.items()))), ensure_ascii=False)
    return json.dumps(shuffle_keys(value, rng), ensure_ascii=False)
