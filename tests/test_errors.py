"""Every error the proxy can answer comes back in OpenAI's shape with the right status."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.helpers import LiveServer, free_port

MODEL = "fake-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text
    return dict(error)


def post(server: LiveServer, body: Any = None, *, content: bytes | None = None, timeout: float = 30) -> httpx.Response:
    headers = {"content-type": "application/json"} if content is not None else None
    return httpx.post(server.url + "/v1/chat/completions", json=body, content=content, headers=headers, timeout=timeout)


def test_malformed_json_is_400(proxy: LiveServer) -> None:
    assert_openai_error(post(proxy, content=b'{"model": "x", "messages": ['), 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": ["hi"]}, "messages[0]"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ([1, 2, 3], None),
    ],
)
def test_not_a_chat_request_is_400(proxy: LiveServer, body: Any, param: str | None) -> None:
    assert assert_openai_error(post(proxy, body), 400)["param"] == param


def test_body_over_limit_is_413(make_proxy: Callable[..., LiveServer]) -> None:
    small = make_proxy(max_body_bytes=1024)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_openai_error(post(small, big), 413)


def test_upstream_unreachable_is_502(make_proxy: Callable[..., LiveServer]) -> None:
    dead = make_proxy(upstream=f"http://127.0.0.1:{free_port()}/v1")
    assert_openai_error(post(dead, CHAT), 502)
    assert_openai_error(httpx.post(dead.url + "/v1/chat/completions", json={**CHAT, "stream": True}), 502)
    assert httpx.get(dead.url + "/readyz").status_code == 503
    assert httpx.get(dead.url + "/healthz").status_code == 200


def test_upstream_timeout_is_504(make_proxy: Callable[..., LiveServer]) -> None:
    slow = make_proxy(upstream_timeout_s=0.3)
    assert_openai_error(post(slow, {**CHAT, "fake_options": {"delay_s": 2}}), 504)


def test_upstream_timeout_is_not_counted_as_proxy_overhead(make_proxy: Callable[..., LiveServer]) -> None:
    slow = make_proxy(upstream_timeout_s=1)
    response = post(slow, {**CHAT, "fake_options": {"delay_s": 2}})
    assert response.status_code == 504
    assert float(response.headers["x-prefix-proxy-overhead-ms"]) < 500


def test_empty_admin_key_disables_the_admin_api(make_proxy: Callable[..., LiveServer]) -> None:
    server = make_proxy(admin_api_key="")
    assert_openai_error(httpx.get(server.url + "/admin/tenants/anonymous/sessions"), 403)


@pytest.mark.parametrize("status", [400, 404, 429, 500, 503])
def test_upstream_errors_pass_through(proxy: LiveServer, status: int) -> None:
    body = {**CHAT, "fake_options": {"status": status, "error_message": f"boom {status}"}}
    error = assert_openai_error(post(proxy, body), status)
    assert error["message"] == f"boom {status}"
    stream_error = assert_openai_error(post(proxy, {**body, "stream": True}), status)
    assert stream_error["message"] == f"boom {status}"


def test_unknown_model_is_upstream_404(proxy: LiveServer) -> None:
    assert_openai_error(post(proxy, {**CHAT, "model": "no-such-model"}), 404)


def test_unknown_route_is_openai_404(proxy: LiveServer) -> None:
    assert_openai_error(httpx.get(proxy.url + "/v1/nothing-here"), 404)


def test_wrong_method_is_openai_405(proxy: LiveServer) -> None:
    response = httpx.get(proxy.url + "/v1/chat/completions")
    assert_openai_error(response, 405)
    assert response.headers["allow"] == "POST"


def test_client_disconnect_closes_upstream_stream(proxy: LiveServer, fake_stats: Callable[[], dict]) -> None:
    before = fake_stats()
    body = {**CHAT, "stream": True, "max_tokens": 200, "fake_options": {"chunk_delay_s": 0.2}}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk: closing the stream drops the connection
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = fake_stats()
        if stats["streams_cancelled"] > before["streams_cancelled"]:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"upstream stream was not closed: {stats}")
    assert stats["streams_completed"] == before["streams_completed"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"model": "fake-model", "input": [{"role": "\ud800", "content": "x"}]}, "input[0].role"),
        ("/v1/responses", {"model": "fake-model", "input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        (
            "/v1/responses",
            {"model": "fake-model", "input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}]},
            "input[0].content[0].text",
        ),
        (
            "/v1/responses",
            {"model": "fake-model", "input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
            "input[0].content[0].text",
        ),
        (
            "/v1/chat/completions",
            {"model": "fake-model", "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
            "messages[0].content[0].text",
        ),
        (
            "/v1/chat/completions",
            {"model": "fake-model", "messages": [{"role": "user", "content": [{"type": "text", "text": 3.5}]}]},
            "messages[0].content[0].text",
        ),
    ],
)
def test_parts_the_proxy_reads_are_judged_as_vllm_does(
    proxy: LiveServer, path: str, body: dict[str, Any], param: str
) -> None:
    """What the proxy reads of a request (roles, a text part's text) is checked as vLLM checks it: a
    400 naming the parameter, never a 500 of the proxy's own nor the upstream's answer relayed."""
    raw = json.dumps(body).encode()  # ensure_ascii: the lone surrogate travels as JSON's \ud800 escape
    response = httpx.post(proxy.url + path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
