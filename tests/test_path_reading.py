"""One path: the proxy's route rules and the engine's router read every path alike.

vLLM serves its routes with Starlette, whose patterns end in ``$`` (in Python, also a match before a
final newline). A path the proxy forwards must reach, at the engine, a route the proxy's rules put in
the same class (the admin's, a refused one, a pipeline the proxy owns, an ordinary tenant route), or
be refused by the proxy before any routing decision. The property test drives the proxy's real app
(its canonical path, its router, the pass-through's decision) and a Starlette router holding vLLM's
routes with the same generated paths, and fails where they disagree.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Match, Route, Router

from proxy.app import create_app
from proxy.config import DEFAULT_ADMIN_ROUTES, TENANT_ROUTES, UNGOVERNED_GENERATION_ROUTES, Settings
from proxy.http.paths import InvalidPath, canonical_path
from proxy.routes.passthrough import KNOWN_ROUTES, PassthroughRoute, route_decision
from tests.helpers import LiveServer

TENANTS = [{"name": "acme", "api_key": "sk-acme"}]
DENIED = ["/tokenize"]

# vLLM 0.32's routes (docs/protocols.md): the pipelines the proxy owns, its admin and generation
# routes, and what the pass-through forwards.
ENGINE_PATHS = sorted(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/v1/embeddings",
        "/v1/models",
        "/metrics",
        *(p.split(" ")[-1] for p in DEFAULT_ADMIN_ROUTES if "*" not in p),
        "/fault_tolerance/apply_config",
        *UNGOVERNED_GENERATION_ROUTES,
        *KNOWN_ROUTES,
        *(p.split(" ")[-1] for p in TENANT_ROUTES if "*" not in p),
    }
)


async def _served(request: Request) -> PlainTextResponse:
    return PlainTextResponse("engine")


ENGINE = Router(routes=[Route(path, _served, methods=["GET", "POST"]) for path in ENGINE_PATHS])


def engine_route(path: str) -> str | None:
    """The route vLLM's router serves ``path`` (as decoded by its server) with, if any."""
    scope = {"type": "http", "path": path, "method": "POST", "root_path": ""}
    for route in ENGINE.routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            assert isinstance(route, Route)
            return route.path
    return None


@pytest.fixture(scope="module")
def app() -> FastAPI:
    return create_app(
        Settings(
            upstream="http://127.0.0.1:9/v1",
            tenants=TENANTS,
            admin_api_key="admin-key",
            routes={"denied_routes": DENIED},
        )
    )


def proxy_reading(app: FastAPI, path: str) -> str:
    """What the proxy does with a decoded ``path``: ``refused`` (400), a route of its own
    (``owned <path>``), or the pass-through's decision (admin, forward, not_found, ungoverned)."""
    try:
        path = canonical_path(path)
    except InvalidPath:
        return "refused"
    scope = {"type": "http", "path": path, "method": "POST", "root_path": "", "headers": []}
    for route in app.router.routes:
        match, child = route.matches(scope)
        if match is Match.NONE:
            continue
        if isinstance(route, PassthroughRoute):
            owned_spelling = child.get("prefix_proxy.owned_spelling", False)
            return route_decision(app.state.proxy, path, "POST", owned_spelling=owned_spelling)
        assert isinstance(route, Route)
        return "owned " + route.path
    return "unmatched"


def class_of(app: FastAPI, reading: str) -> str:
    # An owned route's GET and DELETE variants are the same route to this question.
    return reading.split(" ")[0] if reading.startswith("owned") else reading


# What a hostile client puts in a path, decoded: control characters, whitespace, path parameters,
# what decodes into a query or fragment, a second decoding, look-alike slashes and dots, case.
HOSTILE = [
    "\n",
    "\r",
    "\t",
    "\x00",
    "\x0b",
    "\x0c",
    "\x1f",
    "\x7f",
    " ",
    ";",
    ";x=1",
    "?",
    "#",
    "%",
    "%2F",
    "%0A",
    "\u2215",
    "\uff0f",
    "\u2044",
    "\u3002",
    "\u00a0",
    "\u200b",
    "\\",
    ".",
    "..",
    "/",
    "//",
]


@st.composite
def hostile_paths(draw: st.DrawFn) -> str:
    base = draw(st.sampled_from(ENGINE_PATHS)).replace("{response_id}", "resp_1")
    chars = list(base)
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(chars)))
        chars.insert(at, draw(st.sampled_from(HOSTILE)))
    if draw(st.booleans()):
        chars.append(draw(st.sampled_from(HOSTILE)))
    if draw(st.integers(0, 9)) == 0:
        chars = [c.swapcase() for c in chars]
    return "".join(chars)


@given(path=hostile_paths())
@settings(max_examples=3000, deadline=None)
def test_the_proxy_and_the_engine_read_a_path_alike(app: FastAPI, path: str) -> None:
    reading = proxy_reading(app, path)
    if reading == "refused":
        return
    # The engine sees the path as the proxy forwards it (canonical), or, behind a gateway that
    # passes the client's bytes, as sent: either way it must be a route of the same class.
    for seen_by_engine in {canonical_path(path), path}:
        route = engine_route(seen_by_engine)
        if route is not None:
            example = route.replace("{response_id}", "resp_1")
            assert class_of(app, reading) == class_of(app, proxy_reading(app, example)), (path, route)


@pytest.mark.parametrize("path", [p for p in ENGINE_PATHS if "{" not in p])
@pytest.mark.parametrize("tail", ["\n", "\r\n", "\x00", " ", "\t", ";", ";a=b"])
def test_a_path_with_a_tail_the_engine_ignores_is_refused(app: FastAPI, path: str, tail: str) -> None:
    assert engine_route(path + "\n") == path  # the hole: Starlette's '$' before a final newline
    assert proxy_reading(app, path + tail) == "refused"


# -- over HTTP: the 28 control-character cases of the issue, and nothing upstream ----------------

CONTROL_CASES = [
    "/sleep",
    "/wake_up",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/release_kv_cache_memory",
    "/collective_rpc",
    "/v1/load_lora_adapter",
    "/invocations",
    "/v1/chat/completions/batch",
    "/cohere/v2/chat",
    "/inference/v1/generate",
    "/generative_scoring",
    "/tokenize",
    "/v1/chat/completions",
]


class _Recorder:
    """An upstream that records every request it is asked for, as method and path (and answers 200)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def app(self) -> Callable[..., Any]:
        async def asgi(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
            if scope["type"] != "http":
                return
            with self.lock:
                self.requests.append((scope["method"], scope["path"]))
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": b"{}"})

        return asgi


@pytest.fixture(scope="module")
def recorded() -> Iterator[tuple[LiveServer, _Recorder]]:
    recorder = _Recorder()
    upstream = LiveServer(recorder.app()).start()
    proxy = LiveServer(
        create_app(
            Settings(
                upstream=upstream.url + "/v1",
                tenants=TENANTS,
                admin_api_key="admin-key",
                routes={"denied_routes": DENIED},
            )
        )
    ).start()
    yield proxy, recorder
    proxy.stop()
    upstream.stop()


@pytest.mark.parametrize("path", CONTROL_CASES)
@pytest.mark.parametrize("encoded", ["%0A", "%0D%0A"])
def test_a_control_character_at_the_end_is_400_and_nothing_reaches_the_upstream(
    recorded: tuple[LiveServer, _Recorder], path: str, encoded: str
) -> None:
    proxy, recorder = recorded
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
        connection.request(
            "POST",
            path + encoded,
            body=body,
            headers={"authorization": "Bearer sk-acme", "content-type": "application/json"},
        )
        response = connection.getresponse()
        answer = json.loads(response.read())
    finally:
        connection.close()
    assert response.status == 400
    assert answer["error"]["code"] == "invalid_path"
    # The proxy's own readiness probe (GET /v1/models, in the background, on its own clock) may reach the
    # upstream at any time; the request under test is a POST, and none may.
    assert [request for request in recorder.requests if request[0] == "POST"] == []
