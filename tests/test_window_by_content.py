"""A sliding window recognized by its content (``summarizer.sliding_window_repair: inferred``, the
default): a conversation without a session id whose client drops its oldest turns is repaired as a
named one is, and a conversation whose whole history equals the end of another's (deterministic
replies) never gets the other's messages: the proxy saw it open, and a request that starts with
another live session's opening is never a window slid over this one.

The service on both stores (memory, and a real Redis shared by two replicas), then end to end
through the proxy and the fake vLLM backend (whose replies are a function of the last turn).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.config import SessionSettings, Settings
from proxy.observability.metrics import Metrics
from proxy.openai.usage import Usage
from proxy.sessions.identity import opening_key
from proxy.sessions.memory import MemorySessionStore
from proxy.sessions.redis_store import RedisSessionStore
from proxy.sessions.service import SessionService, SessionView
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer
from tests.redis_server import SHARED_URL, delete_prefix, require_shared_redis, unique_prefix

Messages = list[dict[str, Any]]
SYSTEM = {"role": "system", "content": "You are a helpful assistant of the Porto wine museum."}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def question(turn: int) -> str:
    return f"Question {turn}: which wines of the Douro valley should a visitor taste, and why?"


def answer(turn: int) -> str:
    return f"Answer {turn}: the tawny and the vintage ports, each for its own reasons."


def conversation(first: int, last: int) -> Messages:
    """Questions ``first`` to ``last`` with the answers between them (the deterministic reply)."""
    messages: Messages = []
    for turn in range(first, last + 1):
        messages.append(user(question(turn)))
        if turn < last:
            messages.append(assistant(answer(turn)))
    return messages


# -- the service ----------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def replicas(request: pytest.FixtureRequest) -> AsyncIterator[tuple[SessionService, SessionService]]:
    """Two replicas on one store: what one learns, the other reads from the store alone."""
    if request.param == "memory":
        memory = MemorySessionStore(ttl_s=3600)
        yield SessionService(memory, SessionSettings(), Metrics()), SessionService(memory, SessionSettings(), Metrics())
        return
    require_shared_redis()
    prefix = unique_prefix()
    stores = [RedisSessionStore(SHARED_URL, prefix=prefix, ttl_s=3600, timeout_s=5.0) for _ in range(2)]
    yield (
        SessionService(stores[0], SessionSettings(local_copy_sessions=0), Metrics()),
        SessionService(stores[1], SessionSettings(local_copy_sessions=0), Metrics()),
    )
    for redis_store in stores:
        await redis_store.aclose()
    delete_prefix(SHARED_URL, prefix)


async def turn(sessions: SessionService, messages: Messages, reply: str, tenant: str = "t") -> SessionView:
    view = await sessions.resolve(tenant, [SYSTEM, *messages])
    await sessions.record(view, Usage(10, 2, 0), assistant(reply), [SYSTEM, *messages], 100, None, 60)
    return view


async def play(sessions: SessionService, first: int, last: int) -> SessionView:
    """One conversation from question ``first`` to ``last``, each answered; its last turn's view."""
    view = None
    for current in range(first, last + 1):
        view = await turn(sessions, conversation(first, current), answer(current))
    assert view is not None
    return view


async def test_a_session_remembers_the_opening_it_was_seen_to_open_with(
    replicas: tuple[SessionService, SessionService],
) -> None:
    one, two = replicas
    opened = await turn(one, conversation(0, 0), answer(0))
    start = opened.fingerprints[0]
    await turn(two, conversation(0, 1), answer(1))
    slid = await turn(one, conversation(1, 2), answer(2))  # a window that dropped the first turn
    assert slid.session_id == opened.session_id and slid.slid and not slid.opens_elsewhere
    record = await one.store.get("t", opened.session_id)
    assert record is not None and record.opening == start and record.first_pair != start
    matches, _ = await two.store.lookup("t", [opening_key(start), opening_key(slid.fingerprints[0])])
    assert matches == [opened.session_id, None]  # a slid window's first message opened nothing


async def test_a_conversation_equal_to_the_end_of_another_stays_its_own(
    replicas: tuple[SessionService, SessionService],
) -> None:
    """B opens with A's third question; the replies being deterministic, B's history is A's tail.
    A's turn takes B's pairs back, so B's pairs alone name A: where B opened says it is B."""
    a, b = replicas
    conversation_a = await play(a, 0, 2)
    opened_b = await turn(b, conversation(2, 2), answer(2))
    assert opened_b.session_id != conversation_a.session_id  # a first message: a session of its own
    for current in range(3, 6):
        view_a = await turn(a, conversation(0, current), answer(current))
        view_b = await turn(b, conversation(2, current), answer(current))
        assert view_a.session_id == conversation_a.session_id and not view_a.opens_elsewhere
        assert view_b.session_id == opened_b.session_id and not view_b.opens_elsewhere


async def test_a_request_that_opens_like_another_conversation_is_never_a_slide(
    replicas: tuple[SessionService, SessionService],
) -> None:
    """B opened with A's third question and went its own way; a request that starts there and
    re-sends A's tail does not continue B: it stays A's (its pairs name A) but is no slide of A.
    The price: a genuine slide of A that starts exactly there is not repaired either."""
    a, b = replicas
    conversation_a = await play(a, 0, 3)
    await turn(b, conversation(2, 2), "Something else entirely.")
    view = await b.resolve("t", [SYSTEM, *conversation(2, 4)])
    assert view.session_id == conversation_a.session_id and view.opens_elsewhere
    # A window of A that starts anywhere else is A's slide.
    slid = await b.resolve("t", [SYSTEM, *conversation(1, 4)])
    assert slid.session_id == conversation_a.session_id and slid.slid and not slid.opens_elsewhere


async def test_conversations_that_open_alike_keep_their_own_openings(
    replicas: tuple[SessionService, SessionService],
) -> None:
    """Many conversations open with the same greeting: the newest holds the index entry, and every
    older one still starts with its own opening (never taken for another's)."""
    one, two = replicas
    first = await turn(one, [user("Hello!")], "Hello, how can I help with the museum?")
    second = await turn(two, [user("Hello!")], "Hi! What would you like to know?")
    assert first.session_id != second.session_id
    greeted = [user("Hello!"), assistant("Hello, how can I help with the museum?"), user("Opening hours?")]
    again = await turn(one, greeted, "From 9 to 18.")
    assert again.session_id == first.session_id and not again.opens_elsewhere


async def test_another_tenants_openings_count_for_nothing(replicas: tuple[SessionService, SessionService]) -> None:
    a, b = replicas
    conversation_a = await play(a, 0, 3)
    await turn(b, conversation(2, 2), "Something else entirely.", tenant="other")
    view = await b.resolve("t", [SYSTEM, *conversation(2, 4)])
    assert view.session_id == conversation_a.session_id and view.slid and not view.opens_elsewhere


# -- end to end -----------------------------------------------------------------------------------


@pytest.fixture
def backend() -> Iterator[LiveServer]:
    server = LiveServer(create_fake_app(FakeBackendConfig())).start()
    yield server
    server.stop()


class Client:
    """A Dify-like app: one end user's ``user`` id, no conversation id; what the backend received
    for each request is checked against every message this conversation's client ever sent."""

    def __init__(self, backend: LiveServer, proxy: LiveServer, end_user: str, window: int | None = None) -> None:
        self.backend, self.proxy, self.end_user, self.window = backend, proxy, end_user, window
        self.history: Messages = []
        self.sent: set[tuple[str, str]] = set()
        self.forwarded: list[Messages] = []
        self.actions: list[list[str]] = []

    def ask(self, text: str, delay_s: float = 0.0) -> str:
        """``delay_s``: how long the backend waits before answering (the request is resolved, and
        the backend has it, at once; its turn is recorded only once answered)."""
        self.history.append(user(text))
        window = self.history if self.window is None else self.history[-(self.window + 1) :]
        messages = [SYSTEM, *window]
        self.sent.update((m["role"], m["content"]) for m in messages)
        body = {"model": "fake-model", "messages": messages, "max_tokens": 40, "user": self.end_user}
        if delay_s:
            body["fake_options"] = {"delay_s": delay_s}
        response = httpx.post(self.proxy.url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        self.actions.append(response.headers.get("x-prefix-proxy-actions", "").split(","))
        log = httpx.get(self.backend.url + "/fake/requests", params={"limit": 8}).json()
        forwarded = [entry["body"] for entry in log if entry["body"].get("user") == self.end_user][-1]["messages"]
        foreign = [m for m in forwarded if (m["role"], m["content"]) not in self.sent]
        assert not foreign, f"{self.end_user}'s request got messages its client never sent: {foreign}"
        self.forwarded.append(forwarded)
        reply = str(response.json()["choices"][0]["message"]["content"])
        self.history.append(assistant(reply))
        self.sent.add(("assistant", reply))
        return reply

    def repaired(self, index: int) -> bool:
        return any(action.startswith("window_repaired") for action in self.actions[index])


def proxies(backend: LiveServer, shared: str | None) -> list[LiveServer]:
    """One proxy, or two replicas on one Redis (``shared``: the key prefix)."""
    if shared is None:
        return [LiveServer(create_app(Settings(upstream=backend.url + "/v1"))).start()]
    sessions = {"store": "redis", "redis_url": SHARED_URL, "key_prefix": shared}
    return [LiveServer(create_app(Settings(upstream=backend.url + "/v1", sessions=sessions))).start() for _ in range(2)]


@pytest.fixture(params=["memory", "redis"])
def replica_pair(request: pytest.FixtureRequest, backend: LiveServer) -> Iterator[tuple[LiveServer, LiveServer]]:
    shared = None
    if request.param == "redis":
        require_shared_redis()
        shared = unique_prefix()
    servers = proxies(backend, shared)
    yield servers[0], servers[-1]
    for server in servers:
        server.stop()
    if shared is not None:
        delete_prefix(SHARED_URL, shared)


def test_an_unnamed_sliding_window_is_repaired_and_its_prefix_stays(
    backend: LiveServer, replica_pair: tuple[LiveServer, LiveServer]
) -> None:
    """Dify's memory window (6 messages of history) over 12 turns, ``user`` only: from its first
    slide on, every request goes on from the previous one (its prompt, the reply, the new turn),
    so the backend's cache holds all of it; a window that slid needs a repair to do so."""
    one, two = replica_pair
    client = Client(backend, one, "end-user-17", window=6)
    for current in range(12):
        client.proxy = (one, two)[current % 2]
        client.ask(question(current))
    first_slide = 4  # questions 0-3 fit the window with their answers
    assert not any(client.repaired(i) for i in range(first_slide + 1))
    assert all(client.repaired(i) for i in range(first_slide + 1, 12))
    for before, after in zip(client.forwarded[first_slide:], client.forwarded[first_slide + 1 :], strict=False):
        assert after[: len(before)] == before, "the forwarded prefix moved"
        assert len(after) == len(before) + 2
    # Everything since the first slide's window, as it was sent (the first slide itself, before any
    # tail was kept, went as the client sent it).
    assert client.forwarded[-1][1:] == client.history[2:-1]


def test_a_conversation_equal_to_the_end_of_another_gets_none_of_its_messages(
    backend: LiveServer, replica_pair: tuple[LiveServer, LiveServer]
) -> None:
    """Two end users of one app (one tenant), neither sliding. B opens with A's third question and
    asks what A asks, at the same time (the workload's waves), so the deterministic replies make B's
    history equal A's tail. Recognized by content alone, B's turn looked like A's window sliding
    (and A's like B's): the repair restored A's first turns into B's requests. B's requests hold only
    B's messages, and neither conversation is repaired."""
    one, two = replica_pair
    a = Client(backend, one, "alice")
    b = Client(backend, two, "bob")
    a.ask(question(0))
    a.ask(question(1))
    for current in range(2, 9):
        # Both resolved before either is recorded, A's turn answered last.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            asked = pool.submit(a.ask, question(current), 0.6)
            time.sleep(0.2)
            b.ask(question(current))
            asked.result()
    assert a.history[4:] == b.history  # B's whole history is A's tail
    assert not any(a.repaired(i) or b.repaired(j) for i in range(len(a.actions)) for j in range(len(b.actions)))
    assert all(len(forwarded) == 1 + 2 * index + 1 for index, forwarded in enumerate(b.forwarded))


def test_a_session_kept_without_its_opening_is_not_repaired(
    backend: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store carried over from a build that recorded no openings holds sessions whose start the
    proxy cannot tell: their windows are forwarded as the client sends them, never repaired on
    pairs alone (which could restore another conversation's turns)."""
    original = MemorySessionStore.record_turn

    async def without_opening(self: MemorySessionStore, tenant: str, session_id: str, turn: Any, now: float) -> None:
        await original(self, tenant, session_id, dataclasses.replace(turn, opening=0, opening_key=0), now)

    monkeypatch.setattr(MemorySessionStore, "record_turn", without_opening)
    (proxy,) = proxies(backend, None)
    try:
        client = Client(backend, proxy, "end-user-23", window=6)
        for current in range(8):
            client.ask(question(current))
    finally:
        proxy.stop()
    assert not any(client.repaired(i) for i in range(8))
    assert client.forwarded[-1][1:] == client.history[-8:-1], "the window went as the client sent it"
