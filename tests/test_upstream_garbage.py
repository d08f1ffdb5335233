"""An upstream that answers what its protocol does not allow, or echoes the credentials it was sent.

Real HTTP throughout: a small Starlette upstream under uvicorn, on a port of its own, answers by the
request's model (``GARBAGE``), and the proxy in front of it (``make_proxy``, tests/conftest.py).
The client must get a 502 or an error event in its protocol's shape, never garbage as a success;
usage that cannot be true must not be taken as a count of 0; and no error body may hand the client
the upstream credentials the proxy sent.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bench.hostile_upstream import OK_CHAT, OK_MESSAGE
from proxy.config import Settings
from tests.helpers import LiveServer

DONE = b"data: [DONE]\n\n"
# What a well-behaved upstream answers (the fuzz upstream's own bodies).
CHAT, MESSAGE = OK_CHAT, OK_MESSAGE


def data(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def event(kind: str, payload: Any) -> bytes:
    return f"event: {kind}\n".encode() + data(payload)


def chunk(text: str, usage: Any = None) -> bytes:
    body: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "model": "m"}
    body["choices"] = [{"index": 0, "delta": {"content": text}}] if text else []
    if usage is not None:
        body["usage"] = usage
    return data(body)


def message_start(usage: Any) -> bytes:
    start = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m", "usage": usage}
    return event("message_start", {"type": "message_start", "message": start})


RESPONSE_CREATED = event(
    "response.created",
    {"type": "response.created", "response": {"id": "resp_1", "object": "response", "status": "in_progress"}},
)

# Nonsense usage blocks, each of which a reader that clamps to 0 would take as a real count.
NONSENSE_USAGE = {
    "negative": {"prompt_tokens": -7, "completion_tokens": 3, "total_tokens": -4},
    "not-integers": {"prompt_tokens": "many", "completion_tokens": 2.5},
    "no-prompt": {"completion_tokens": 3},
    "absurd-prompt": {"prompt_tokens": 10**15, "completion_tokens": 1, "total_tokens": 10**15 + 1},
    "more-cached-than-prompted": {
        "prompt_tokens": 10,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 500},
    },
}


def sse(*events: bytes) -> StreamingResponse:
    async def body() -> Any:
        for piece in events:
            yield piece

    return StreamingResponse(body(), media_type="text/event-stream")


def echo(request: Request) -> str:
    return request.headers.get("authorization", "<none>")


def answer(request: Request, model: str, stream: bool) -> Response:
    """What the garbage upstream answers ``model`` on this path."""
    path = request.url.path
    if model == "json-list":
        return Response(b"[1,2,3]", media_type="application/json")
    if model == "json-without-list":
        return JSONResponse({"id": "x", "object": "something", "model": "m"})
    if model == "sse-not-json":
        return sse(chunk("one"), b"data: this is not json\n\n", chunk("two"), DONE)
    if model == "sse-array":
        return sse(chunk("one"), b"data: [1,2,3]\n\n", DONE)
    if model == "sse-binary":
        return sse(chunk("one"), b"\x00\x9c\xfe\xff\x13garbage\x07\n\n", DONE)
    if model == "sse-broken-json":
        return sse(chunk("one"), b'data: {"usage": {"prompt_tokens": 3,,}\n\n', DONE)
    if model == "sse-no-end":
        if path.endswith("/messages"):
            return sse(message_start({"input_tokens": 5, "output_tokens": 0}))
        if path.endswith("/responses"):
            return sse(RESPONSE_CREATED)
        return sse(chunk("one"), chunk("two"))
    if model == "sse-done-unterminated":  # [DONE] without the blank line after it: still the end
        return sse(chunk("one"), b"data: [DONE]")
    if model.startswith("usage-"):
        usage = NONSENSE_USAGE.get(model.removeprefix("usage-"), CHAT["usage"])
        if stream:
            return sse(chunk("one"), chunk("", usage=usage), DONE)
        return JSONResponse({**CHAT, "usage": usage})
    if model == "anthropic-nonsense-usage":
        if stream:
            return sse(
                message_start({"input_tokens": "lots", "output_tokens": 0}),
                event("message_delta", {"type": "message_delta", "delta": {}, "usage": {"input_tokens": -2}}),
                event("message_stop", {"type": "message_stop"}),
            )
        return JSONResponse({**MESSAGE, "usage": {"input_tokens": -3, "output_tokens": 2}})
    if model == "anthropic-ok":
        return JSONResponse(MESSAGE)
    if model.startswith("echo-4"):  # an upstream that quotes the credentials it was sent: echo-401, echo-400-detail
        status = int(model[5:8])
        if model.endswith("-detail"):
            return JSONResponse({"detail": f"Authorization header was {echo(request)!r}"}, status_code=status)
        if model.endswith("-anthropic"):
            error = {"type": "authentication_error", "message": f"invalid x-api-key / {echo(request)}"}
            return JSONResponse({"type": "error", "error": error}, status_code=status)
        error = {
            "message": f"invalid credentials: {echo(request)}",
            "type": "authentication_error",
            "code": str(status),
        }
        return JSONResponse({"error": error}, status_code=status)
    if model == "echo-stream-error":
        error = {"message": f"denied for {echo(request)}", "type": "auth", "code": "401"}
        return sse(chunk("one"), data({"error": error}), DONE)
    return JSONResponse(CHAT)


def garbage_app(seen: list[dict[str, str]]) -> Starlette:
    async def generate(request: Request) -> Response:
        seen.append(dict(request.headers))
        raw = await request.body()
        body = json.loads(raw) if raw else {}
        return answer(request, str(body.get("model")), body.get("stream") is True)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]})

    paths = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/tokenize"]
    return Starlette(
        routes=[Route("/v1/models", models), *(Route(p, generate, methods=["POST"]) for p in paths)],
    )


class Garbage:
    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.server = LiveServer(garbage_app(self.headers), name="garbage-upstream").start()
        self.port = self.server.port
        self.url = self.server.url + "/v1"


@pytest.fixture(scope="module")
def garbage() -> Iterator[Garbage]:
    upstream = Garbage()
    yield upstream
    upstream.server.stop()


@pytest.fixture
def proxy_for(make_proxy: Callable[..., LiveServer], garbage: Garbage) -> Callable[..., LiveServer]:
    def make(**settings: Any) -> LiveServer:
        if "upstreams" not in settings:  # one of them (upstream beside upstreams is refused)
            settings.setdefault("upstream", garbage.url)
        return make_proxy(**settings)

    return make


# -- requests in each protocol ---------------------------------------------------------------------

ROUTES = {
    "chat": ("/v1/chat/completions", lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", lambda m: {"model": m, "prompt": "hi"}),
    "messages": (
        "/v1/messages",
        lambda m: {"model": m, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    ),
    "responses": ("/v1/responses", lambda m: {"model": m, "input": "hi"}),
}


def send(proxy: LiveServer, route: str, model: str, *, stream: bool = False, key: str | None = None) -> httpx.Response:
    path, build = ROUTES[route]
    body = build(model)
    if stream:
        body["stream"] = True
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(proxy.url + path, json=body, headers=headers, timeout=30)


def events(response: httpx.Response) -> list[tuple[str | None, str]]:
    """(event name, data) of each event of an SSE body."""
    out = []
    for block in response.text.split("\n\n"):
        name, payload = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                payload = line[6:]
        if payload is not None:
            out.append((name, payload))
    return out


def stream_error(route: str, response: httpx.Response) -> dict[str, Any]:
    """The error event the stream ended with, in the route's protocol's shape; its error object."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    name, payload = events(response)[-1]
    parsed = json.loads(payload)
    if route == "messages":
        assert name == "error"
        assert parsed["type"] == "error" and parsed["error"]["type"] == "api_error"
        return dict(parsed["error"])
    assert set(parsed["error"]) == {"message", "type", "param", "code"}
    return dict(parsed["error"])


def access_line(lines: list[str], model: str, *, stream: bool) -> dict[str, Any]:
    """The access-log line of the request for ``model`` (a stream's is written once it has ended,
    which may be just after its client read the last byte)."""
    deadline = time.monotonic() + 5
    while True:
        for line in lines:
            entry = json.loads(line)
            if entry.get("model") == model and entry.get("stream") is stream:
                return dict(entry)
        assert time.monotonic() < deadline, f"no access-log line for {model}"
        time.sleep(0.02)


def upstream_errors(proxy: LiveServer, kind: str, route: str) -> float:
    text = httpx.get(proxy.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "prefix_proxy_upstream_errors_total" and sample.labels == {"route": route, "kind": kind}:
                return float(sample.value)
    return 0.0


# -- whole answers that are not the protocol's --------------------------------------------------------


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("model", ["json-list", "json-without-list"])
def test_a_whole_answer_that_is_not_the_protocols_is_502(
    proxy_for: Callable[..., LiveServer], route: str, model: str
) -> None:
    proxy = proxy_for()
    response = send(proxy, route, model)
    assert response.status_code == 502, response.text
    body = response.json()
    if route == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
    else:
        assert body["error"]["code"] == "upstream_invalid_response"
        assert body["error"]["type"] == "upstream_error"
    assert "[1,2,3]" not in response.text
    assert upstream_errors(proxy, "invalid_response", route) == 1


def test_a_json_answer_to_a_stream_request_is_checked_too(proxy_for: Callable[..., LiveServer]) -> None:
    """Some servers ignore ``stream``; their one JSON body gets the same check."""
    response = send(proxy_for(), "chat", "json-list", stream=True)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_invalid_response"


# -- streams that are not the protocol's -------------------------------------------------------------


@pytest.mark.parametrize("model", ["sse-not-json", "sse-array", "sse-binary", "sse-broken-json"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_stream_event_that_is_not_json_ends_the_stream_with_an_error_event(
    proxy_for: Callable[..., LiveServer], model: str, route: str
) -> None:
    proxy = proxy_for()
    response = send(proxy, route, model, stream=True)
    error = stream_error(route, response)
    assert error["code"] == "upstream_invalid_response"
    relayed = events(response)
    assert json.loads(relayed[0][1])["choices"][0]["delta"]["content"] == "one"  # what came before
    assert "[DONE]" not in response.text  # nothing after the garbage either
    assert "garbage" not in response.text and "not json" not in response.text
    assert upstream_errors(proxy, "invalid_response", route) == 1


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_stream_that_ends_before_the_protocols_end_gets_an_error_event(
    proxy_for: Callable[..., LiveServer], route: str
) -> None:
    proxy = proxy_for()
    response = send(proxy, route, "sse-no-end", stream=True)
    error = stream_error(route, response)
    if route != "messages":
        assert error["code"] == "upstream_stream_truncated"
    assert "ended before" in error["message"]
    assert len(events(response)) >= 2  # the upstream's events came through, then the error


def test_done_without_its_blank_line_still_ends_the_stream(proxy_for: Callable[..., LiveServer]) -> None:
    """The protocol's last event, cut off before its blank line, is the end: relayed ended, so that
    an SSE client dispatches it (it drops an event the body ends inside of)."""
    response = send(proxy_for(), "chat", "sse-done-unterminated", stream=True)
    assert response.status_code == 200
    assert response.text.endswith("}\n\ndata: [DONE]\n\n")
    assert "error" not in response.text


# -- usage that cannot be true -----------------------------------------------------------------------


@pytest.mark.parametrize("nonsense", list(NONSENSE_USAGE))
def test_nonsense_usage_in_a_whole_answer_is_no_usage(proxy_for: Callable[..., LiveServer], nonsense: str) -> None:
    proxy = proxy_for()
    control = send(proxy, "chat", "usage-valid")
    assert control.headers["x-prefix-proxy-prompt-tokens"] == "5"
    response = send(proxy, "chat", f"usage-{nonsense}")
    assert response.status_code == 200  # the answer itself is fine: relayed as it came
    assert response.json()["usage"] == NONSENSE_USAGE[nonsense]
    assert "x-prefix-proxy-prompt-tokens" not in response.headers  # not "0", not 10**15
    assert upstream_errors(proxy, "invalid_usage", "chat") == 1


@pytest.mark.parametrize("nonsense", list(NONSENSE_USAGE))
def test_nonsense_usage_in_a_stream_is_no_usage(
    proxy_for: Callable[..., LiveServer], access_lines: list[str], nonsense: str
) -> None:
    proxy = proxy_for()
    response = send(proxy, "chat", f"usage-{nonsense}", stream=True)
    assert response.status_code == 200
    assert events(response)[-1] == (None, "[DONE]")
    line = access_line(access_lines, f"usage-{nonsense}", stream=True)
    assert line["prompt_tokens"] is None and line["completion_tokens"] is None
    assert upstream_errors(proxy, "invalid_usage", "chat") == 1


def test_nonsense_anthropic_usage_is_no_usage(proxy_for: Callable[..., LiveServer], access_lines: list[str]) -> None:
    proxy = proxy_for()
    assert send(proxy, "messages", "anthropic-ok").headers["x-prefix-proxy-prompt-tokens"] == "5"
    response = send(proxy, "messages", "anthropic-nonsense-usage")
    assert response.status_code == 200
    assert "x-prefix-proxy-prompt-tokens" not in response.headers
    streamed = send(proxy, "messages", "anthropic-nonsense-usage", stream=True)
    assert events(streamed)[-1][0] == "message_stop"
    assert access_line(access_lines, "anthropic-nonsense-usage", stream=True)["prompt_tokens"] is None


# -- credentials the proxy sent, echoed back ----------------------------------------------------------

BASIC = "Basic " + base64.b64encode(b"admin:hunter2").decode()  # Basic YWRtaW46aHVudGVyMg==


def assert_scrubbed(response: httpx.Response, *secrets: str) -> None:
    for secret in secrets:
        assert secret not in response.text, response.text
    assert "[redacted]" in response.text, response.text


@pytest.mark.parametrize("model", ["echo-400", "echo-400-detail"])
def test_basic_credentials_from_the_url_are_scrubbed_from_an_error(
    proxy_for: Callable[..., LiveServer], garbage: Garbage, model: str
) -> None:
    proxy = proxy_for(upstream=f"http://admin:hunter2@127.0.0.1:{garbage.port}/v1")
    response = send(proxy, "chat", model)
    assert garbage.headers[-1]["authorization"] == BASIC  # what the upstream was sent, and echoed
    assert response.status_code == 400
    assert response.json()["error"]["message"]
    assert_scrubbed(response, "YWRtaW46aHVudGVyMg==", "hunter2")


def test_the_upstream_api_key_is_scrubbed_from_an_error(proxy_for: Callable[..., LiveServer], garbage: Garbage) -> None:
    proxy = proxy_for(upstream_api_key="sk-upstream-0123456789")
    response = send(proxy, "chat", "echo-400")
    assert garbage.headers[-1]["authorization"] == "Bearer sk-upstream-0123456789"
    assert response.status_code == 400
    assert_scrubbed(response, "sk-upstream-0123456789")


def test_a_tenants_upstream_key_is_scrubbed_from_an_error(
    proxy_for: Callable[..., LiveServer], garbage: Garbage
) -> None:
    proxy = proxy_for(tenants=[{"name": "acme", "api_key": "pp-acme", "upstream_api_key": "sk-acme-upstream-42"}])
    response = send(proxy, "chat", "echo-400", key="pp-acme")
    assert garbage.headers[-1]["authorization"] == "Bearer sk-acme-upstream-42"
    assert response.status_code == 400
    assert_scrubbed(response, "sk-acme-upstream-42")


def test_credentials_are_scrubbed_from_an_anthropic_error(
    proxy_for: Callable[..., LiveServer], garbage: Garbage
) -> None:
    proxy = proxy_for(upstream_api_key="sk-upstream-0123456789")
    response = send(proxy, "messages", "echo-400-anthropic")
    assert response.status_code == 400
    assert response.json()["type"] == "error"
    assert_scrubbed(response, "sk-upstream-0123456789")


@pytest.mark.parametrize(
    ("settings", "key", "refused"),
    [
        ({"upstream_api_key": "sk-upstream-0123456789"}, None, "its upstream_api_key"),
        (
            {"tenants": [{"name": "acme", "api_key": "pp-acme", "upstream_api_key": "sk-acme-upstream-42"}]},
            "pp-acme",
            "the tenant's upstream_api_key",
        ),
        ({"tenants": [{"name": "acme", "api_key": "pp-acme"}]}, "pp-acme", "no key: upstream_api_key is not set"),
    ],
)
@pytest.mark.parametrize("model", ["echo-401", "echo-403-detail"])
def test_an_upstream_refusing_the_proxys_credentials_is_a_server_error_not_the_clients(
    proxy_for: Callable[..., LiveServer],
    garbage: Garbage,
    settings: dict[str, Any],
    key: str | None,
    refused: str,
    model: str,
) -> None:
    """Issue 47: the client's key was fine; the proxy's was refused. 502 upstream_auth_failed, the
    upstream's body (which quotes the key) not passed on."""
    proxy = proxy_for(**settings)
    response = send(proxy, "chat", model, key=key)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_auth_failed" and error["type"] == "upstream_error"
    assert error["message"].startswith(f"the upstream refused the proxy's credentials ({refused}; HTTP {model[5:8]})")
    assert "sk-" not in response.text and "pp-acme" not in response.text
    anthropic = send(proxy, "messages", "echo-401-anthropic", key=key)
    assert anthropic.status_code == 502
    assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "api_error"
    assert "upstream refused the proxy's credentials" in anthropic.json()["error"]["message"]
    passed = httpx.post(
        proxy.url + "/tokenize",
        json={"model": "echo-401", "prompt": "hi"},
        headers={"authorization": f"Bearer {key}"} if key else {},
        timeout=30,
    )
    assert passed.status_code == 502 and passed.json()["error"]["code"] == "upstream_auth_failed"


def test_an_open_proxy_without_a_key_says_the_upstream_wants_one(
    proxy_for: Callable[..., LiveServer], garbage: Garbage
) -> None:
    """No tenants, no upstream key: the client's credentials go upstream as they are; refused, the
    client (whose key an open proxy does not ask for) is told the proxy lacks upstream_api_key."""
    proxy = proxy_for()
    response = send(proxy, "chat", "echo-401", key="client-key")
    assert garbage.headers[-1]["authorization"] == "Bearer client-key"
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_auth_failed"
    assert "(the client's key, passed on: upstream_api_key is not set; HTTP 401)" in response.text
    assert "client-key" not in response.text


def test_credentials_are_scrubbed_from_a_stream_error_event(
    proxy_for: Callable[..., LiveServer], garbage: Garbage
) -> None:
    proxy = proxy_for(upstream=f"http://admin:hunter2@127.0.0.1:{garbage.port}/v1")
    response = send(proxy, "chat", "echo-stream-error", stream=True)
    assert response.status_code == 200
    assert "denied for" in response.text
    assert_scrubbed(response, "YWRtaW46aHVudGVyMg==", "hunter2")


def test_credentials_are_scrubbed_from_a_passed_through_routes_error(
    proxy_for: Callable[..., LiveServer], garbage: Garbage
) -> None:
    proxy = proxy_for(upstream_api_key="sk-upstream-0123456789")
    response = httpx.post(proxy.url + "/tokenize", json={"model": "echo-400", "prompt": "hi"}, timeout=30)
    assert response.status_code == 400
    assert_scrubbed(response, "sk-upstream-0123456789")


# -- upstream URLs that cannot be right ---------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, names",
    [
        ({"upstream": "http://admin:hunter2@vllm:8000/v1", "upstream_api_key": "sk-k"}, "upstream_api_key"),
        (
            {
                "upstreams": ["http://vllm-a:8000/v1", "http://admin:hunter2@vllm-b:8000/v1"],
                "tenants": [{"name": "acme", "api_key": "pp-acme", "upstream_api_key": "sk-acme"}],
            },
            "tenants['acme'].upstream_api_key",
        ),
    ],
)
def test_credentials_in_the_url_beside_an_upstream_key_are_a_config_error(settings: dict[str, Any], names: str) -> None:
    with pytest.raises(ValidationError) as raised:
        Settings(**settings)
    message = str(raised.value)
    assert names in message and "user:password@" in message
    assert "hunter2" not in message and "sk-" not in message  # the error never echoes a secret
    # Either kind of credentials alone is fine.
    assert Settings(upstream="http://admin:hunter2@vllm:8000/v1").upstream_urls
    assert Settings(upstream="http://vllm:8000/v1", upstream_api_key="sk-k").upstream_api_key is not None


@pytest.mark.parametrize("url", ["http://vllm:8000/v1?api-version=2024-10-21", "http://vllm:8000/v1#x", "http://v/v1?"])
def test_a_query_string_or_fragment_in_an_upstream_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ValidationError, match="query string or fragment"):
        Settings(upstream=url)
    with pytest.raises(ValidationError, match="query string or fragment"):
        Settings(upstreams=["http://ok:8000/v1", url])


def test_a_placeholder_key_is_scrubbed_only_where_it_is_a_credential() -> None:
    """vLLM's docs use keys like "EMPTY": replacing it everywhere would mangle answers (an upstream
    key "1" inside "code": 401). A short key is scrubbed in its Authorization form only."""
    from proxy.backends.upstream import Redactor, key_forms

    scrub = Redactor(key_forms("1"))
    echoed = b'{"error": {"message": "bad header Authorization: Bearer 1", "code": 401}}'
    assert scrub(echoed) == b'{"error": {"message": "bad header Authorization: [redacted]", "code": 401}}'
    long_key = "sk-upstream-0123456789"
    assert Redactor(key_forms(long_key))(f"key {long_key} refused".encode()) == b"key [redacted] refused"


# -- a 2xx answer of the pass-through that echoes the request's headers (a debug build, a gateway) --
ECHO_TENANTS = [{"name": "acme", "api_key": "sk-acme"}]
UPSTREAM_KEY = "sk-upstream-very-secret-0123456789"


async def echo_headers(request: Request) -> JSONResponse:
    # A debugging build / misconfigured gateway in front of the engine: 200 with what it was sent.
    return JSONResponse({"count": 1, "tokens": [1], "max_model_len": 4096, "debug": dict(request.headers)})


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]})


@pytest.fixture
def echo_upstream() -> Iterator[LiveServer]:
    server = LiveServer(
        Starlette(routes=[Route("/tokenize", echo_headers, methods=["POST"]), Route("/v1/models", models)])
    ).start()
    yield server
    server.stop()


def test_an_upstream_2xx_echo_does_not_hand_a_tenant_the_upstream_key(
    make_proxy: Callable[..., LiveServer], echo_upstream: LiveServer
) -> None:
    proxy = make_proxy(upstream=echo_upstream.url + "/v1", upstream_api_key=UPSTREAM_KEY, tenants=ECHO_TENANTS)
    r = httpx.post(
        proxy.url + "/tokenize",
        headers={"authorization": "Bearer sk-acme"},
        json={"model": "m", "prompt": "hi"},
    )
    assert r.status_code == 200, r.text
    assert UPSTREAM_KEY not in r.text, r.text


def test_a_credential_split_across_chunks_is_redacted() -> None:
    """The pass-through relays a body as it comes: a credential split across two chunks (or a
    single byte at a time) is found whole; text around it is relayed as it was."""
    import asyncio

    from proxy.backends import Redactor

    body = b'{"debug": {"authorization": "Bearer ' + UPSTREAM_KEY.encode() + b'"}, "ok": true}'

    async def relayed(size: int) -> bytes:
        async def chunks() -> AsyncIterator[bytes]:
            for at in range(0, len(body), size):
                yield body[at : at + size]

        return b"".join([chunk async for chunk in Redactor([UPSTREAM_KEY]).stream(chunks())])

    expected = body.replace(UPSTREAM_KEY.encode(), b"[redacted]")
    assert all(asyncio.run(relayed(size)) == expected for size in (1, 7, 40, len(body)))


def test_a_stream_is_held_back_only_where_a_credential_could_begin() -> None:
    """An event's end goes to the client with its chunk: only bytes that could start a credential
    wait for the next chunk."""
    import asyncio

    from proxy.backends import Redactor

    async def relayed(parts: list[bytes]) -> list[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            for part in parts:
                yield part

        return [chunk async for chunk in Redactor([UPSTREAM_KEY]).stream(chunks())]

    events = [b'data: {"text": "a"}\n\n', b'data: {"text": "b"}\n\n']
    assert asyncio.run(relayed(events)) == events
    split = [b'data: "' + UPSTREAM_KEY[:5].encode(), UPSTREAM_KEY[5:].encode() + b'"\n\n']
    assert asyncio.run(relayed(split)) == [b'data: "', b'[redacted]"\n\n']
