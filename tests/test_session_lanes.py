"""Lanes within a named session: a request that shares the session but does not extend its
conversation (a title, tags or follow-up request, a sub-agent) neither slides the window nor
becomes the predecessor of the next turn, and window repair restores only what the client sent.

Service and store level first (memory and a real Redis), then end to end through the proxy and the
fake vLLM backend: an Open WebUI-shaped chat with its background tasks in the chat's own session,
a genuine sliding-window client in a named session, a sub-agent.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.config import SessionSettings, Settings
from proxy.observability.metrics import Metrics
from proxy.openai.usage import Usage
from proxy.sessions.memory import MemorySessionStore
from proxy.sessions.model import TurnRecord
from proxy.sessions.redis_store import RedisSessionStore
from proxy.sessions.service import SessionService
from proxy.sessions.store import SessionStore
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer
from tests.redis_server import SHARED_URL, delete_prefix, require_shared_redis, unique_prefix

Messages = list[dict[str, Any]]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CHAT = [
    SYSTEM,
    user("What should I see in Belem?"),
    assistant("The tower and the monastery."),
    user("And eat?"),
    assistant("Pasteis."),
    user("Where?"),
]
# The client's window slid: it re-sends the last two turns only.
WINDOW = [SYSTEM, *CHAT[2:]]


# -- the stores -------------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        yield MemorySessionStore(ttl_s=3600)
        return
    require_shared_redis()
    prefix = unique_prefix()
    redis_store = RedisSessionStore(SHARED_URL, prefix=prefix, ttl_s=3600, timeout_s=5.0)
    yield redis_store
    await redis_store.aclose()
    delete_prefix(SHARED_URL, prefix)


async def test_a_side_lane_turn_counts_but_leaves_the_conversation_in_place(store: SessionStore) -> None:
    now = time.time()
    await store.record_turn("t", "s", TurnRecord(100, 50, 10, 0.3, [1, 2], 3, 2, 1), now)
    await store.record_turn("t", "s", TurnRecord(40, 0, 5, 0.25, [], 9, 8, 7, side_lane=True), now + 1)
    record = await store.get("t", "s")
    assert record is not None
    assert (record.first_pair, record.last_pair, record.last_request_pair) == (1, 3, 2)
    assert record.context_tokens == 100  # the conversation's context, not the side task's
    assert (record.requests, record.prompt_tokens, record.completion_tokens) == (2, 140, 15)
    assert record.fingerprints == 2
    assert record.last_seen == pytest.approx(now + 1)


# -- the service --------------------------------------------------------------------------------------


class CountingStore(MemorySessionStore):
    lookups = 0

    async def lookup(self, tenant: str, fingerprints: list[int]) -> tuple[list[str | None], dict[str, float]]:
        self.lookups += 1
        return await super().lookup(tenant, fingerprints)


def service(store: SessionStore) -> SessionService:
    return SessionService(store, SessionSettings(), Metrics())


async def answered(sessions: SessionService, messages: Messages, reply: str, named: str = "xs") -> Any:
    view = await sessions.resolve("t", messages, named)
    await sessions.record(view, Usage(10, 2, 0), assistant(reply), messages, 100, None, 60)
    return view


async def test_what_extends_a_named_session_and_what_is_a_side_lane() -> None:
    store = CountingStore(ttl_s=3600)
    sessions = service(store)
    first = await answered(sessions, CHAT[:2], "The tower and the monastery.")
    assert first.lane is None  # no turn yet: the conversation itself
    # The next turns: same first pair, no lookup.
    assert (await answered(sessions, CHAT[:4], "Pasteis.")).lane is None
    turn = await sessions.resolve("t", CHAT, "xs")
    assert turn.lane is None and not turn.slid and store.lookups == 0
    # A title request quoting the chat as text: one message, nothing shared: a side lane, no lookup.
    title = [SYSTEM, user("### Task: a title\n<chat_history>USER: What should I see in Belem?</chat_history>")]
    side = await answered(sessions, title, "Belem sights")
    assert side.lane is not None and side.side_lane and not side.slid and store.lookups == 0
    record = await store.get("t", "xs")
    assert record is not None and record.first_pair == first.fingerprints[0]
    # A sub-agent with a conversation of its own: its history shares nothing (one lookup), and its
    # own pairs were not recorded as the session's, so its second turn is a side lane too.
    agent = [{"role": "system", "content": "You search files."}, user("find main"), assistant("ok"), user("more")]
    agent_view = await answered(sessions, agent[:2], "ok")
    assert agent_view.side_lane
    again = await sessions.resolve("t", agent, "xs")
    assert again.side_lane and again.lane == agent_view.lane and store.lookups == 1
    # The chat goes on where it was; a window that slid still extends it (and slides).
    assert not (await sessions.resolve("t", CHAT, "xs")).side_lane
    slid = await sessions.resolve("t", WINDOW, "xs")
    assert slid.lane is None and slid.slid and store.lookups == 1  # it re-sends the latest reply


async def test_a_sliding_window_older_than_the_last_turn_is_found_by_one_lookup() -> None:
    store = CountingStore(ttl_s=3600)
    sessions = service(store)
    history: Messages = []
    for turn in range(4):
        history.append(user(f"question {turn}"))
        await answered(sessions, [SYSTEM, *history], f"answer {turn}")
        history.append(assistant(f"answer {turn}"))
    # Re-sends turns 1 and 2 only (not the latest request or reply): the pairs decide.
    window = [SYSTEM, *history[3:6], user("question 9")]
    view = await sessions.resolve("t", window, "xs")
    assert view.lane is None and view.slid and store.lookups == 1


class SharedStore(MemorySessionStore):
    """Stands for a shared store (the service keeps a copy beside it) that can go down."""

    in_process = False
    down = False

    async def get(self, tenant: str, session_id: str) -> Any:
        if self.down:
            raise ConnectionError("down")
        return await super().get(tenant, session_id)

    async def lookup(self, tenant: str, fingerprints: list[int]) -> tuple[list[str | None], dict[str, float]]:
        if self.down:
            raise ConnectionError("down")
        return await super().lookup(tenant, fingerprints)


async def test_the_replicas_copy_tells_lanes_apart_as_the_store_does() -> None:
    """The store down, this replica's copy (which recorded the same turns) decides the same way."""
    shared = SharedStore(ttl_s=3600)
    metrics = Metrics()
    sessions = SessionService(shared, SessionSettings(), metrics)
    assert sessions.local is not None
    await answered(sessions, CHAT[:2], "The tower and the monastery.")
    await answered(sessions, [user("### Task: tags")], "travel")
    await answered(sessions, CHAT[:4], "Pasteis.")
    local, stored = await sessions.local.get("t", "xs"), await shared.get("t", "xs")
    assert local is not None and stored is not None
    assert (local.first_pair, local.last_pair, local.requests) == (stored.first_pair, stored.last_pair, 3)
    requests = (CHAT, [user("### Task: follow-ups")], WINDOW, [SYSTEM, user("find"), assistant("x"), user("y")])
    from_store = [await sessions.resolve("t", messages, "xs") for messages in requests]
    shared.down = True
    from_copy = [await sessions.resolve("t", messages, "xs") for messages in requests]
    assert metrics.registry.get_sample_value("prefix_proxy_store_fallbacks_total") == len(requests)
    assert [(v.lane, v.slid) for v in from_copy] == [(v.lane, v.slid) for v in from_store]
    assert [v.side_lane for v in from_copy] == [False, True, False, True]


async def test_a_session_the_proxy_knows_has_no_lanes() -> None:
    """A Responses chain sends the new turn alone: the proxy knows it continues the chain."""
    sessions = service(MemorySessionStore(ttl_s=3600))
    await answered(sessions, [user("one")], "1")
    assert not (await sessions.resolve("t", [user("two")], "xs", lanes=False)).side_lane
    assert (await sessions.resolve("t", [user("two")], "xs")).side_lane


# -- end to end -------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "web_search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]


def owui_system(second: int) -> str:
    """Open WebUI's system prompt with {{CURRENT_DATETIME}}: a line relocation moves."""
    return (
        "You are a friendly assistant for the Lisbon travel office.\n"
        f"Today is Monday 2025-06-02, time 17:{44 + second // 60:02d}:{second % 60:02d}.\n"
        "User: Ana\n"
        "Answer briefly and cite sources when you use the web_search tool."
    )


@pytest.fixture
def servers() -> Iterator[tuple[LiveServer, LiveServer]]:
    backend = LiveServer(create_fake_app(FakeBackendConfig())).start()
    settings = Settings(upstream=backend.url + "/v1", summarizer={"sliding_window_repair": "named"})
    proxy = LiveServer(create_app(settings)).start()
    yield backend, proxy
    proxy.stop()
    backend.stop()


class Client:
    """Sends chat requests and checks what the backend received for each against what was sent."""

    def __init__(self, backend: LiveServer, proxy: LiveServer) -> None:
        self.backend, self.proxy = backend, proxy
        self.sent: dict[str, set[tuple[str, str]]] = {}  # per lane: every message the client sent in it
        self.actions: list[str] = []

    def post(self, messages: Messages, headers: dict[str, str], lane: str, **body: Any) -> httpx.Response:
        response = httpx.post(
            self.proxy.url + "/v1/chat/completions",
            json={"model": "fake-model", "messages": messages, "max_tokens": 30, **body},
            headers=headers,
            timeout=30,
        )
        assert response.status_code == 200, response.text
        self.actions.extend(filter(None, response.headers.get("x-prefix-proxy-actions", "").split(",")))
        received = httpx.get(self.backend.url + "/fake/requests", params={"limit": 1}).json()[-1]["body"]
        self.check(received["messages"], messages, lane)
        return response

    def check(self, forwarded: Messages, messages: Messages, lane: str) -> None:
        """Each forwarded message is one the client sent (in this request, or earlier in this lane:
        a repaired window), or a block the proxy made of lines of this request's system prompt."""
        sent = self.sent.setdefault(lane, set())
        sent.update((m["role"], m["content"]) for m in messages)
        system_lines = {line for m in messages if m["role"] == "system" for line in m["content"].split("\n")}
        for message in forwarded:
            if (message["role"], message["content"]) in sent:
                continue
            assert message["role"] == "system", f"the backend got a message the client never sent: {message}"
            assert set(message["content"].split("\n")) <= system_lines, f"not this request's lines: {message}"


def history_text(history: Messages) -> str:
    return "\n".join(f"{m['role'].upper()}: {m['content']}" for m in history)


def test_open_webui_background_tasks_are_side_lanes_of_the_chat(servers: tuple[LiveServer, LiveServer]) -> None:
    backend, proxy = servers
    client = Client(backend, proxy)
    # Another chat of the app first: the time line is seen to vary, so it moves from the first turn on.
    for second in (300, 301):
        messages = [{"role": "system", "content": owui_system(second)}, user(f"hello {second}")]
        client.post(messages, {"X-OpenWebUI-Chat-Id": "chat-warm"}, "warm", tools=TOOLS, tool_choice="none")

    headers = {"X-OpenWebUI-Chat-Id": "chat-lisbon"}
    questions = [
        "What should I see in Belem?",
        "And where do I eat pasteis?",
        "Is the tram 28 worth it?",
        "What about Sintra?",
        "How do I get to Cascais?",
    ]
    history: Messages = []
    causes, sessions, requests = [], set(), 0
    for turn, question in enumerate(questions):
        history.append(user(question))
        system = {"role": "system", "content": owui_system(17 * turn)}
        response = client.post([system, *history], headers, "chat", tools=TOOLS, tool_choice="none")
        causes.append(response.headers["x-prefix-proxy-cache-break"].split(";")[0])
        sessions.add(response.headers["x-prefix-proxy-session"])
        history.append(assistant(response.json()["choices"][0]["message"]["content"]))
        requests += 1
        # The background tasks: the chat's system prompt (or none), no tools, one user message.
        tasks = ["Suggest 3-5 relevant follow-up questions"]
        if turn == 0:
            tasks = ["Generate a concise, 3-5 word title", "Generate 1-3 broad tags", *tasks]
        for task in tasks:
            later = {"role": "system", "content": owui_system(17 * turn + 3)}
            prompt = user(
                f"### Task:\n{task}\n### Chat History:\n<chat_history>\n{history_text(history)}\n</chat_history>"
            )
            side = client.post([later, prompt] if "tags" not in task else [prompt], headers, task)
            sessions.add(side.headers["x-prefix-proxy-session"])
            requests += 1

    assert len(sessions) == 1  # the chat's session: the tasks' spend is the chat's
    assert not [action for action in client.actions if action.startswith("window_repaired")]
    # The chat's own turns: its first, then appended turns; the block of moved time lines moves on
    # with each turn (what relocation costs), never the tools or the system prompt.
    assert causes[0] == "new_conversation"
    assert set(causes[1:]) <= {"none", "volatile_moved"}, causes
    listed = httpx.get(proxy.url + f"/v1/sessions/{sessions.pop()}").json()
    assert listed["requests"] == requests


def test_a_sliding_window_in_a_named_session_is_repaired_with_the_clients_messages_only(
    servers: tuple[LiveServer, LiveServer],
) -> None:
    """The repair tail leaves out the proxy's blocks of moved lines: it matches the client's next
    window (the block has moved on meanwhile) and restores only what the client sent."""
    backend, proxy = servers
    client = Client(backend, proxy)
    history: Messages = []
    repaired = []
    for turn in range(8):
        history.append(user(f"Plan day {turn} of my Lisbon trip with museums and food."))
        system = {"role": "system", "content": owui_system(7 * turn)}
        response = client.post([system, *history[-4:]], {"x-session-id": "slide-1"}, "slide")
        actions = response.headers.get("x-prefix-proxy-actions", "")
        repaired.append(any(action.startswith("window_repaired") for action in actions.split(",")))
        history.append(assistant(response.json()["choices"][0]["message"]["content"]))
    assert all(repaired[3:]), repaired


def test_a_sub_agent_in_the_session_is_labelled_system_changed(servers: tuple[LiveServer, LiveServer]) -> None:
    backend, proxy = servers
    client = Client(backend, proxy)
    headers = {"x-claude-code-session-id": "agent-session"}
    common = "\n".join(f"Environment line {i}: the repository is at /work/app." for i in range(6))
    main = {"role": "system", "content": f"You are the main coding agent.\n{common}"}
    history: Messages = [user("Fix the failing test.")]
    first = client.post([main, *history], headers, "main", tools=TOOLS, tool_choice="none")
    history += [assistant(first.json()["choices"][0]["message"]["content"]), user("Now run it.")]
    second = client.post([main, *history], headers, "main", tools=TOOLS, tool_choice="none")
    assert second.headers["x-prefix-proxy-cache-break"] == "none"
    agent = {"role": "system", "content": f"You are a file search sub-agent.\n{common}"}
    tools = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]
    response = client.post([agent, user("Find the test file.")], headers, "agent", tools=tools, tool_choice="none")
    assert response.headers["x-prefix-proxy-cache-break"].startswith("system_changed; message=0; line=1;")
    # The main agent's next turn is still compared with its own previous one (not the sub-agent's:
    # that would read system_changed). The sub-agent taught the canonicalizer that the first line
    # varies in this app, so it may move it now (volatile_moved).
    history += [assistant(second.json()["choices"][0]["message"]["content"]), user("Commit it.")]
    third = client.post([main, *history], headers, "main", tools=TOOLS, tool_choice="none")
    assert third.headers["x-prefix-proxy-cache-break"].split(";")[0] in ("none", "volatile_moved")
