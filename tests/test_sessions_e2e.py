"""Sessions, tenants and budgets through the real proxy and the fake backend (in-memory store)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.helpers import LiveServer, chat, steady_window_s

MODEL = "fake-model"
SYSTEM = {"role": "system", "content": "You are a travel agent. Answer in two sentences."}


def converse(server: LiveServer, questions: list[str], window: int | None = None, key: str | None = None) -> list[str]:
    """Play a conversation; with ``window``, the client re-sends only its last ``window`` messages."""
    history: list[dict[str, Any]] = []
    sessions = []
    for question in questions:
        history.append({"role": "user", "content": question})
        sent = history if window is None else history[-window:]
        response = chat(server, [SYSTEM, *sent], key=key, max_tokens=30)
        assert response.status_code == 200, response.text
        sessions.append(response.headers["x-prefix-proxy-session"])
        history.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    return sessions


def test_sliding_window_client_keeps_its_session(proxy: LiveServer) -> None:
    questions = [f"Plan day {i} of my trip to Lisbon, including museums and food." for i in range(1, 9)]
    sessions = converse(proxy, questions, window=4)
    assert len(set(sessions)) == 1


def test_two_interleaved_conversations_of_one_user_stay_apart(proxy: LiveServer) -> None:
    a: list[dict[str, Any]] = []
    b: list[dict[str, Any]] = []
    ids: dict[str, set[str]] = {"a": set(), "b": set()}
    for turn in range(4):
        for name, history, topic in (("a", a, "Kyoto"), ("b", b, "Oslo")):
            opening = f"hi, I am planning a trip to {topic}"
            history.append({"role": "user", "content": opening if turn == 0 else f"more about {topic}, part {turn}"})
            response = chat(proxy, [SYSTEM, *history], max_tokens=30)
            ids[name].add(response.headers["x-prefix-proxy-session"])
            history.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    assert len(ids["a"]) == 1 and len(ids["b"]) == 1
    assert ids["a"] != ids["b"]


def test_explicit_session_header_wins(proxy: LiveServer) -> None:
    first = chat(proxy, [SYSTEM, {"role": "user", "content": "one"}], max_tokens=30)
    headers = {"x-session-id": "my-conversation-42"}
    body = {"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": "two"}], "max_tokens": 5}
    a = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
    b = httpx.post(proxy.url + "/v1/chat/completions", json={**body, "messages": [SYSTEM]}, headers=headers)
    assert a.headers["x-prefix-proxy-session"] == b.headers["x-prefix-proxy-session"]
    assert a.headers["x-prefix-proxy-session"] != first.headers["x-prefix-proxy-session"]
    cache_key = chat(
        proxy, [SYSTEM, {"role": "user", "content": "x"}], prompt_cache_key="my-conversation-42", max_tokens=30
    )
    assert cache_key.headers["x-prefix-proxy-session"] == a.headers["x-prefix-proxy-session"]


@pytest.mark.parametrize(
    "header", ["X-OpenWebUI-Chat-Id", "X-Claude-Code-Session-Id", "session-id", "x-opencode-session"]
)
def test_the_session_headers_clients_send_name_the_session(proxy: LiveServer, header: str) -> None:
    chat_id = f"chat-{uuid.uuid4()}"
    sessions = set()
    for question in ("first question", "an unrelated second one"):
        body = {"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": question}], "max_tokens": 5}
        response = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={header: chat_id})
        sessions.add(response.headers["x-prefix-proxy-session"])
    assert len(sessions) == 1, "two requests without shared history, one named session"


def test_session_headers_are_an_ordered_list(make_proxy: Callable[..., LiveServer]) -> None:
    proxy = make_proxy(sessions={"headers": ["x-my-app-conversation", "x-session-id"]})
    body = {"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 5}

    def session(headers: dict[str, str]) -> str:
        response = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
        return response.headers["x-prefix-proxy-session"]

    named = session({"x-my-app-conversation": "c-1"})
    assert session({"x-my-app-conversation": "c-1", "x-session-id": "other"}) == named, "the first listed wins"
    assert session({"x-session-id": "c-1"}) == named, "the same id under a later header: the same session"
    assert session({"x-openwebui-chat-id": "c-1"}) != named, "a header left out of the list is not read"


def test_the_single_header_setting_still_works() -> None:
    from proxy.config import SESSION_HEADERS, SessionSettings

    settings = SessionSettings.model_validate({"header": "X-Conversation"})
    assert settings.headers == ["X-Conversation", *SESSION_HEADERS]
    assert SessionSettings.model_validate({"headers": "a, b"}).headers == ["a", "b"]


TENANTS = [
    {"name": "acme", "api_key": "sk-acme-0123456789"},
    {"name": "globex", "api_key": "sk-globex-9876543210"},
]


@pytest.fixture
def keyed_proxy(make_proxy: Callable[..., LiveServer]) -> LiveServer:
    return make_proxy(tenants=TENANTS, admin_api_key="admin-secret")


def test_missing_or_wrong_key_is_401(keyed_proxy: LiveServer) -> None:
    for key in (None, "sk-wrong"):
        response = chat(keyed_proxy, [SYSTEM, {"role": "user", "content": "hi"}], key=key, max_tokens=30)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    models = httpx.get(keyed_proxy.url + "/v1/models")
    assert models.status_code == 401


def test_tenants_cannot_see_or_reset_each_others_sessions(keyed_proxy: LiveServer) -> None:
    acme = converse(keyed_proxy, ["Book a flight to Rome", "Make it business class"], key="sk-acme-0123456789")
    session_id = acme[0]
    as_acme = {"authorization": "Bearer sk-acme-0123456789"}
    as_globex = {"authorization": "Bearer sk-globex-9876543210"}

    own = httpx.get(f"{keyed_proxy.url}/v1/sessions/{session_id}", headers=as_acme)
    assert own.status_code == 200 and own.json()["requests"] == 2 and own.json()["tenant"] == "acme"
    assert httpx.get(f"{keyed_proxy.url}/v1/sessions/{session_id}", headers=as_globex).status_code == 404
    assert httpx.delete(f"{keyed_proxy.url}/v1/sessions/{session_id}", headers=as_globex).status_code == 404
    assert httpx.get(f"{keyed_proxy.url}/v1/sessions", headers=as_globex).json()["data"] == []
    assert httpx.get(f"{keyed_proxy.url}/v1/sessions/{session_id}", headers=as_acme).status_code == 200

    # The same conversation sent by globex is a different session: fingerprints are tenant-scoped too.
    globex = converse(keyed_proxy, ["Book a flight to Rome", "Make it business class"], key="sk-globex-9876543210")
    assert session_id not in globex

    admin = {"authorization": "Bearer admin-secret"}
    listed = httpx.get(f"{keyed_proxy.url}/admin/tenants/acme/sessions", headers=admin).json()["data"]
    assert [s["session_id"] for s in listed] == [session_id]
    assert httpx.get(f"{keyed_proxy.url}/admin/tenants/acme/sessions", headers=as_acme).status_code == 401
    reset = httpx.delete(f"{keyed_proxy.url}/admin/tenants/acme/sessions/{session_id}", headers=admin)
    assert reset.status_code == 200
    assert httpx.get(f"{keyed_proxy.url}/v1/sessions/{session_id}", headers=as_acme).status_code == 404


def test_context_over_hard_limit_is_answered_by_the_proxy(make_proxy: Callable[..., LiveServer]) -> None:
    server = make_proxy(budget={"context_limit_tokens": 300})
    response = chat(server, [SYSTEM, {"role": "user", "content": "tell me everything " * 400}], max_tokens=30)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert chat(server, [SYSTEM, {"role": "user", "content": "short"}], max_tokens=30).status_code == 200


def test_over_the_models_context_the_engine_judges(proxy: LiveServer) -> None:
    """The limit derived from the model (max_model_len - max_tokens) is the engine's to enforce:
    the proxy forwards, and relays whatever the engine answers (never stricter than it). vLLM 0.32
    clamps a max_tokens the context cannot hold, and refuses a prompt that is itself too long."""
    models = httpx.get(proxy.url + "/v1/models").json()["data"]
    max_model_len = models[0]["max_model_len"]
    response = chat(proxy, [SYSTEM, {"role": "user", "content": "hello " * 50}], max_tokens=max_model_len - 20)
    assert response.status_code == 200, response.text
    assert "summary" not in response.headers.get("x-prefix-proxy-actions", "")
    response = chat(proxy, [SYSTEM, {"role": "user", "content": "hello " * (max_model_len + 10)}], max_tokens=30)
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]  # the engine's own words


def test_session_budget_exhaustion_is_429_with_retry_after(make_proxy: Callable[..., LiveServer]) -> None:
    window_s = steady_window_s()
    server = make_proxy(budget={"session_tokens_per_window": 400, "window_s": window_s})
    statuses = []
    history: list[dict[str, Any]] = [SYSTEM]
    for i in range(8):
        history.append({"role": "user", "content": f"question {i} about the budget"})
        response = chat(server, history, max_tokens=20)
        statuses.append(response.status_code)
        if response.status_code != 200:
            break
        history.append(response.json()["choices"][0]["message"])
    assert statuses[0] == 200 and statuses[-1] == 429
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert 0 < int(response.headers["retry-after"]) <= window_s


def test_exact_counts_from_the_backends_tokenize(
    make_proxy: Callable[..., LiveServer], fake_backend: LiveServer
) -> None:
    """Near the limit the proxy asks the backend's /tokenize instead of estimating."""
    messages = [SYSTEM, {"role": "user", "content": "count me " * 60 + "now"}]
    exact = httpx.post(fake_backend.url + "/tokenize", json={"model": MODEL, "messages": messages}).json()["count"]
    just_fits = make_proxy(budget={"context_limit_tokens": exact, "exact_counts_via_tokenize": True})
    assert chat(just_fits, messages, max_tokens=30).status_code == 200
    too_small = make_proxy(budget={"context_limit_tokens": exact - 1, "exact_counts_via_tokenize": True})
    response = chat(too_small, messages, max_tokens=30)
    assert response.status_code == 400
    assert f"about {exact} tokens" in response.json()["error"]["message"]


def test_a_stream_cut_short_gives_back_the_unused_reservation(make_proxy: Callable[..., LiveServer]) -> None:
    """A stream the client abandons is charged its prompt, not the max_tokens reserved for it."""
    server = make_proxy(budget={"session_tokens_per_window": 100_000, "window_s": steady_window_s()})
    headers = {"x-session-id": f"cut-{uuid.uuid4()}"}
    body = {
        "model": MODEL,
        "max_tokens": 8000,
        "stream": True,
        "messages": [SYSTEM, {"role": "user", "content": "hi"}],
        # A long reply, slow enough for the client to leave in the middle of it.
        "fake_options": {"chunk_delay_s": 0.005, "reply": "and so the story goes on " * 200},
    }
    events = 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers) as response:
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 300:
                break  # the client leaves after 300 events (tokens)
    time.sleep(0.5)  # the proxy settles in the background
    # A complete request creates the session record, whose budget_left shows what was charged.
    again = {"model": MODEL, "max_tokens": 10, "messages": [SYSTEM, {"role": "user", "content": "hi again"}]}
    finished = httpx.post(server.url + "/v1/chat/completions", json=again, headers=headers, timeout=30)
    assert finished.status_code == 200
    time.sleep(0.3)
    session = finished.headers["x-prefix-proxy-session"]
    state = httpx.get(f"{server.url}/v1/sessions/{session}", headers=headers).json()
    left = state["budget_left"]["session"]
    assert left > 100_000 - 1_500  # was 100,000 - 8,000 - prompt: max_tokens stayed charged
    # ... but what was streamed is charged: leaving early does not make tokens free.
    assert left <= 100_000 - 300 - state["prompt_tokens"]


def test_the_admin_sees_the_budgets_the_tenant_sees(make_proxy: Callable[..., LiveServer]) -> None:
    tenants = [
        {
            **TENANTS[0],
            "budget": {
                "session_tokens_per_window": 50_000,
                "tenant_tokens_per_window": 90_000,
                "window_s": steady_window_s(),
            },
        }
    ]
    server = make_proxy(tenants=tenants, admin_api_key="admin-secret")
    session_id = converse(server, ["Book a flight to Rome"], key=TENANTS[0]["api_key"])[-1]
    own = httpx.get(
        f"{server.url}/v1/sessions/{session_id}", headers={"authorization": f"Bearer {TENANTS[0]['api_key']}"}
    )
    admin = httpx.get(
        f"{server.url}/admin/tenants/{TENANTS[0]['name']}/sessions/{session_id}",
        headers={"authorization": "Bearer admin-secret"},
    )
    assert own.status_code == admin.status_code == 200
    assert set(own.json()["budget_left"]) == {"session", "tenant"}
    assert admin.json()["budget_left"] == own.json()["budget_left"]
