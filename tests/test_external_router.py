"""The proxy in front of a real external router (vLLM Router, SGLang Model Gateway) in front of
fake vLLM backends: ``routing.key_headers`` keeps each conversation on one backend."""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from bench.routers import SMG_KEY_HEADER, VLLM_ROUTER_KEY_HEADER, router_available, smg_router, vllm_router
from proxy.app import create_app
from proxy.backends.keyheaders import KeyHeaders, key_digest
from proxy.config import Settings
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer
from tests.redis_server import SHARED_URL, delete_prefix, require_shared_redis, unique_prefix

SYSTEM = {"role": "system", "content": "You answer questions about garden tools in one sentence."}


@pytest.fixture
def backends() -> Iterator[list[LiveServer]]:
    servers = [LiveServer(create_fake_app(FakeBackendConfig())).start() for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


def require(command: str) -> None:
    if not router_available(command):
        pytest.fail(f"{command} is not installed (it is in the test extras: pip install -e '.[test]')")


def converse(base_url: str, conversations: int = 6, turns: int = 3) -> None:
    """``conversations`` inferred conversations (no session header), ``turns`` turns each, interleaved."""
    histories: list[list[dict[str, Any]]] = [[SYSTEM] for _ in range(conversations)]
    for turn in range(turns):
        for number, history in enumerate(histories):
            history.append({"role": "user", "content": f"Conversation {number}, question {turn}: rakes or hoes?"})
            response = httpx.post(
                base_url + "/chat/completions",
                json={"model": "fake-model", "messages": history, "max_tokens": 16},
                timeout=30,
            )
            assert response.status_code == 200, response.text
            history.append(response.json()["choices"][0]["message"])


def placement(backends: list[LiveServer]) -> dict[str, set[int]]:
    """Conversation (its first user message) -> the backends that served any of its requests."""
    where: dict[str, set[int]] = defaultdict(set)
    for index, backend in enumerate(backends):
        for record in httpx.get(backend.url + "/fake/requests", timeout=10).json():
            body = record.get("body") or {}
            first = next((m["content"] for m in body.get("messages", []) if m.get("role") == "user"), None)
            if first is not None:
                where[first.split(",")[0]].add(index)
    return where


def routed_headers(backends: list[LiveServer], name: str) -> dict[str, set[str]]:
    values: dict[str, set[str]] = defaultdict(set)
    for backend in backends:
        for record in httpx.get(backend.url + "/fake/requests", timeout=10).json():
            body = record.get("body") or {}
            first = next((m["content"] for m in body.get("messages", []) if m.get("role") == "user"), "")
            values[first.split(",")[0]].add(record["headers"].get(name, ""))
    return values


def test_key_headers_carry_a_stable_digest_of_the_routing_key(backends: list[LiveServer]) -> None:
    settings = Settings(upstream=backends[0].url + "/v1", routing={"key_headers": "X-Session-Id,x-smg-routing-key"})
    # Two replicas: the same conversation must get the same value from each.
    proxies = [LiveServer(create_app(settings)).start() for _ in range(2)]
    try:
        converse(proxies[0].url + "/v1", conversations=3, turns=1)
        converse(proxies[1].url + "/v1", conversations=3, turns=2)
    finally:
        for proxy in proxies:
            proxy.stop()
    values = routed_headers(backends, "x-session-id")
    assert len(values) == 3
    for conversation, seen in values.items():
        assert len(seen) == 1, f"{conversation}: one value on every turn, from either replica"
        value = next(iter(seen))
        assert re.fullmatch(r"[0-9a-f]{32}", value), f"{value!r}: a digest, no tenant name, no prompt text"
    assert len({next(iter(v)) for v in values.values()}) == 3, "conversations get different keys"
    assert routed_headers(backends, SMG_KEY_HEADER) == values, "every listed header carries the same key"


def test_key_header_names_are_checked() -> None:
    for bad in ("authorization", "x-request-id", "two words", ""):
        with pytest.raises(ValueError, match="key_headers"):
            KeyHeaders([bad])
    assert KeyHeaders(["X-A"]).apply(None, "k") == {"x-a": key_digest("k")}
    assert KeyHeaders(["X-A"]).apply({"b": "1"}, None) == {"b": "1"}


# Enough conversations that a lopsided ring (5 of 6 on one backend was common) still puts some on each.
CONVERSATIONS = 40


def run_through_router(backends: list[LiveServer], router_url: str, key_headers: list[str]) -> dict[str, set[int]]:
    settings = Settings(upstream=router_url + "/v1", routing={"key_headers": key_headers})
    proxy = LiveServer(create_app(settings)).start()
    try:
        converse(proxy.url + "/v1", conversations=CONVERSATIONS)
    finally:
        proxy.stop()
    return placement(backends)


def test_vllm_router_consistent_hash_keeps_each_conversation_on_one_backend(backends: list[LiveServer]) -> None:
    require("vllm-router")
    with vllm_router([b.url for b in backends], "consistent_hash", 60) as router:
        where = run_through_router(backends, router, [VLLM_ROUTER_KEY_HEADER])
    assert len(where) == CONVERSATIONS
    assert all(len(served) == 1 for served in where.values()), where
    assert set().union(*where.values()) == {0, 1}, "conversations are spread over both backends"


def test_without_key_headers_vllm_router_scatters_conversations(backends: list[LiveServer]) -> None:
    """The control: consistent_hash then hashes what it finds (the proxy's per-request x-request-id)."""
    require("vllm-router")
    with vllm_router([b.url for b in backends], "consistent_hash", 60) as router:
        where = run_through_router(backends, router, [])
    assert any(len(served) > 1 for served in where.values()), where


def test_smg_routing_key_headers_keep_each_conversation_on_one_backend(backends: list[LiveServer]) -> None:
    require("smg")
    with smg_router([b.url for b in backends], "consistent_hashing", [SMG_KEY_HEADER], 60) as router:
        where = run_through_router(backends, router, [SMG_KEY_HEADER])
    assert len(where) == CONVERSATIONS
    assert all(len(served) == 1 for served in where.values()), where
    assert set().union(*where.values()) == {0, 1}, "conversations are spread over both backends"


class SessionTokenRouter:
    """llm-d's session affinity as seen from outside: every answer names the pod that served it in
    ``x-session-token``; a request carrying a token is served by that pod. The pods are fake vLLM
    backends; this forwarder records which token each request carried."""

    def __init__(self, pods: list[LiveServer]) -> None:
        self.pods = pods
        self.received: list[str | None] = []
        self._next = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            return
        request = Request(scope, receive)
        token = request.headers.get("x-session-token")
        if request.url.path.endswith("/chat/completions"):
            self.received.append(token)
        if token is not None and token.isdigit() and int(token) < len(self.pods):
            pod = int(token)
        else:  # a new conversation: the next pod
            pod, self._next = self._next, (self._next + 1) % len(self.pods)
        async with httpx.AsyncClient(base_url=self.pods[pod].url, timeout=30) as client:
            answer = await client.request(
                request.method,
                request.url.path,
                content=await request.body(),
                headers={"content-type": "application/json"},
            )
        response = Response(answer.content, answer.status_code, media_type="application/json")
        response.headers["x-session-token"] = str(pod)
        await response(scope, receive, send)


def test_a_routers_session_token_is_echoed_from_the_session_store_across_replicas(
    backends: list[LiveServer],
) -> None:
    require_shared_redis()
    prefix = unique_prefix()
    router = SessionTokenRouter(backends)
    server = LiveServer(router).start()
    settings = Settings(
        upstream=server.url + "/v1",
        sessions={"store": "redis", "redis_url": SHARED_URL, "key_prefix": prefix},
        routing={"echo_headers": ["x-session-token"]},
    )
    replicas = [LiveServer(create_app(settings)).start() for _ in range(2)]
    try:
        histories: list[list[dict[str, Any]]] = [[SYSTEM] for _ in range(4)]
        for turn in range(3):
            for number, history in enumerate(histories):
                history.append({"role": "user", "content": f"Conversation {number}, question {turn}: spades?"})
                # Round robin over the replicas: the token must come from the shared store.
                response = httpx.post(
                    replicas[(turn + number) % 2].url + "/v1/chat/completions",
                    json={"model": "fake-model", "messages": history, "max_tokens": 16},
                    timeout=30,
                )
                assert response.status_code == 200, response.text
                assert "x-session-token" not in response.headers, "the router's token stays between it and the proxy"
                history.append(response.json()["choices"][0]["message"])
                time.sleep(0.05)  # the token is saved in the background
    finally:
        for replica in replicas:
            replica.stop()
        server.stop()
        delete_prefix(SHARED_URL, prefix)
    first_turns, later_turns = router.received[:4], router.received[4:]
    assert first_turns == [None] * 4, "a new conversation carries no token"
    assert all(token is not None for token in later_turns), "every later turn echoes its pod's token"
    where = placement(backends)
    assert len(where) == 4 and all(len(served) == 1 for served in where.values()), where
