"""The typed errors of proxy.http.errors: each class's status, type and code (what clients get), and
what control flow reads from the type over real HTTP: a client that leaves mid-upload is logged as
``client_disconnected``, an upstream connection lost after the request went out is counted as its own
kind of upstream error (``connection_lost``), apart from ``unreachable`` and ``timeout``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.hostile_upstream import HostileUpstream
from proxy.backends.upstream import upstream_error_kind
from proxy.http.errors import (
    BodyTooDeep,
    BudgetExceeded,
    ClientDisconnected,
    ClientError,
    ContextLengthExceeded,
    DeadlineExceeded,
    Forbidden,
    InvalidLimit,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ProxyError,
    RequestTimeout,
    ResponseNotFound,
    ServerError,
    ServiceUnavailable,
    SessionNotFound,
    Unauthorized,
    UnroutablePath,
    UnsupportedMediaType,
    UpstreamConnectionLost,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from tests.helpers import LiveServer, chat, free_port

HI = [{"role": "user", "content": "hi"}]

# (error, its family, status, type, code, message): what a client gets for each class, as before the tree.
TREE: list[tuple[ProxyError, type[ProxyError], int, str, str | None, str]] = [
    (InvalidRequest("'model' is required", param="model"), ClientError, 400, "invalid_request_error", None,
     "'model' is required"),
    (ContextLengthExceeded(900, 800), InvalidRequest, 400, "invalid_request_error", "context_length_exceeded",
     "This conversation needs about 900 tokens, over its context budget of 800 tokens (context_limit_tokens). "
     "Shorten the history."),
    (BodyTooDeep(64), InvalidRequest, 400, "invalid_request_error", "too_deep",
     "request body nests deeper than 64 levels"),
    (UnroutablePath(), InvalidRequest, 400, "invalid_request_error", "invalid_path",
     "the path names no route (dot segments above the root, or an encoded separator)"),
    (InvalidLimit(), InvalidRequest, 400, "invalid_request_error", "invalid_limit",
     "'limit' must be a positive integer"),
    (Unauthorized(), ClientError, 401, "invalid_request_error", "invalid_api_key", "invalid or missing API key"),
    (Forbidden("the admin API is disabled (set admin_api_key)"), ClientError, 403, "permission_error", None,
     "the admin API is disabled (set admin_api_key)"),
    (NotFound("no route /x"), ClientError, 404, "not_found_error", "not_found", "no route /x"),
    (SessionNotFound("s1"), NotFound, 404, "not_found_error", "session_not_found", "no session 's1'"),
    (ResponseNotFound("resp_1", "response_id"), NotFound, 404, "invalid_request_error", "404",
     "Response with id 'resp_1' not found."),
    (RequestTimeout(), ClientError, 408, "invalid_request_error", "request_timeout",
     "the request did not arrive within the server's read deadline"),
    (PayloadTooLarge(1024), ClientError, 413, "invalid_request_error", "request_too_large",
     "request body exceeds the limit of 1024 bytes"),
    (UnsupportedMediaType(), ClientError, 415, "invalid_request_error", "unsupported_media_type",
     "the request body must be JSON, sent with content-type: application/json"),
    (BudgetExceeded("tenant", 30), ClientError, 429, "rate_limit_error", "tenant_budget_exceeded",
     "The tenant token budget for this window is spent; retry after 30 s."),
    (ClientDisconnected(), ClientError, 499, "invalid_request_error", "client_disconnected",
     "the client closed the connection before sending the whole body"),
    (ServiceUnavailable("the session store is unavailable"), ServerError, 503, "server_error", "store_unavailable",
     "the session store is unavailable"),
    (UpstreamUnreachable("ConnectError"), UpstreamError, 502, "upstream_error", "upstream_unreachable",
     "upstream unreachable: ConnectError"),
    (UpstreamConnectionLost("ReadError"), UpstreamError, 502, "upstream_error", "upstream_connection_lost",
     "upstream closed the connection: ReadError"),
    (UpstreamProtocolError("its answer is not JSON"), UpstreamError, 502, "upstream_error",
     "upstream_invalid_response", "the upstream answered with an invalid response: its answer is not JSON"),
    (UpstreamTimeout(), UpstreamError, 504, "upstream_error", "upstream_timeout", "upstream timed out"),
    (DeadlineExceeded(), UpstreamTimeout, 504, "upstream_error", "request_deadline_exceeded",
     "the request exceeded its deadline"),
]  # fmt: skip


@pytest.mark.parametrize("error, family, status, type_, code, message", TREE, ids=lambda v: type(v).__name__)
def test_each_class_carries_its_status_type_and_code(
    error: ProxyError, family: type[ProxyError], status: int, type_: str, code: str | None, message: str
) -> None:
    assert isinstance(error, family)
    assert (error.status, error.type, error.code, error.message, str(error)) == (status, type_, code, message, message)
    assert error.body() == {"error": {"message": message, "type": type_, "param": error.param, "code": code}}
    response = error.response()
    assert response.status_code == status
    assert json.loads(bytes(response.body)) == error.body()
    # Status, type and code belong to the class (the budget's code names its budget, per instance).
    if not isinstance(error, BudgetExceeded):
        assert (type(error).status, type(error).type, type(error).code) == (status, type_, code)
    # Every 4xx is a ClientError, every 5xx a ServerError; the two families do not overlap.
    assert isinstance(error, ClientError) == (status < 500) != isinstance(error, ServerError)


def test_params_and_headers_are_the_instances() -> None:
    assert ContextLengthExceeded(2, 1).param == "messages"
    assert InvalidLimit().param == "limit"
    assert ResponseNotFound("r", "previous_response_id").param == "previous_response_id"
    assert Unauthorized("invalid admin key").headers == {"www-authenticate": "Bearer"}
    assert BudgetExceeded("session", 7).headers == {"retry-after": "7"}
    assert BudgetExceeded("session", 7).code == "session_budget_exceeded"
    assert BudgetExceeded.code is None  # the class names no budget
    assert ServiceUnavailable("x", headers={"retry-after": "1"}).response().headers["retry-after"] == "1"


def test_the_base_class_still_answers_an_error_no_class_names() -> None:
    error = ProxyError(429, "slow down", code="rate_limited")
    assert (error.status, error.type, error.code) == (429, "invalid_request_error", "rate_limited")
    assert not isinstance(error, ClientError | ServerError)


def test_each_upstream_error_maps_to_its_kind() -> None:
    assert upstream_error_kind(UpstreamUnreachable("ConnectError")) == "unreachable"
    assert upstream_error_kind(UpstreamConnectionLost("ReadError")) == "connection_lost"
    assert upstream_error_kind(UpstreamProtocolError("not JSON")) == "invalid_response"
    assert upstream_error_kind(UpstreamTimeout()) == "timeout"
    assert upstream_error_kind(DeadlineExceeded()) == "timeout"


# -- over real HTTP -------------------------------------------------------------------------------


def access_line(lines: list[str], predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first access-log line matching ``predicate`` (written once the request has ended)."""
    deadline = time.monotonic() + 5
    while True:
        for line in lines:
            entry = json.loads(line)
            if predicate(entry):
                return dict(entry)
        assert time.monotonic() < deadline, f"no such access-log line in {lines}"
        time.sleep(0.02)


# The pipeline's body (proxy.http.body), and a passed-through JSON body, read for its model (routes.passthrough:
# its 499 had no code, and was logged as invalid_request_error).
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_client_leaving_mid_upload_is_logged_499_client_disconnected(
    proxy: LiveServer, access_lines: list[str], path: str
) -> None:
    request_id = f"left-{free_port()}"
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-request-id: {request_id}\r\n"
            "content-length: 100000\r\n\r\n".encode()
            + b'{"model": "fake-model", '
        )
        time.sleep(0.2)
    line = access_line(access_lines, lambda entry: entry.get("request_id") == request_id)
    assert line["status"] == 499
    assert line["error"] == "client_disconnected"


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileUpstream]:
    server = CuttingUpstream().start()
    yield server
    server.stop()


class CuttingUpstream(HostileUpstream):
    """The hostile upstream, with one more behaviour: ``cut`` answers 200 with a Content-Length and
    half of that body, then hangs up: the connection is lost in the middle of the answer."""

    async def _behave(self, model: str, stream: bool, writer: asyncio.StreamWriter, path: str = "") -> bool:
        if model != "cut":
            return await super()._behave(model, stream, writer, path)
        body = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "choices": []}).encode()
        head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body) * 2}\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        return False


def upstream_errors(proxy: LiveServer, route: str = "chat") -> dict[str, float]:
    """``prefix_proxy_upstream_errors_total`` of ``route``, by kind."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(proxy.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "prefix_proxy_upstream_errors_total" and sample.labels["route"] == route:
                counts[sample.labels["kind"]] = sample.value
    return counts


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


@pytest.mark.parametrize("model", ["drop", "cut"])
def test_a_connection_lost_mid_answer_is_counted_as_connection_lost(
    make_proxy: Callable[..., LiveServer], hostile: HostileUpstream, model: str
) -> None:
    """``drop``: the upstream reads the request and hangs up before answering; ``cut``: it hangs up
    halfway through its body. Either way the request went out: 502 upstream_connection_lost, counted
    as ``connection_lost``, not as ``unreachable`` (what the alert on a dead upstream reads alone)."""
    proxy = make_proxy(upstream=hostile.url)
    error = openai_error(chat(proxy, HI, model=model), 502)
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_connection_lost")
    assert error["message"].startswith("upstream closed the connection: ")
    counts = upstream_errors(proxy)
    assert counts.get("connection_lost") == 1
    assert counts.get("unreachable") == 0 and counts.get("timeout") == 0


def test_a_refused_connection_is_still_counted_as_unreachable(make_proxy: Callable[..., LiveServer]) -> None:
    proxy = make_proxy(upstream=f"http://127.0.0.1:{free_port()}/v1")
    error = openai_error(chat(proxy, HI, model="ok"), 502)
    assert error["code"] == "upstream_unreachable"
    counts = upstream_errors(proxy)
    assert counts.get("unreachable") == 1 and counts.get("connection_lost", 0) == 0


def test_the_request_deadline_is_counted_as_a_timeout(
    make_proxy: Callable[..., LiveServer], hostile: HostileUpstream
) -> None:
    proxy = make_proxy(upstream=hostile.url, upstream_timeout_s=2, request_timeout_s=1)
    error = openai_error(chat(proxy, HI, model="drip"), 504)
    assert (error["type"], error["code"]) == ("upstream_error", "request_deadline_exceeded")
    counts = upstream_errors(proxy)
    assert counts.get("timeout") == 1 and counts.get("connection_lost", 0) == 0
