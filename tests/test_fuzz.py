"""Fuzzing in CI, bounded (about 20 s): hostile HTTP against a real proxy (uvicorn) in front of an
upstream that answers anything, so any 5xx is the proxy's own. Every answer is < 500, every error
body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``, and nothing is logged at
ERROR. ``python -m bench.fuzz --requests N`` runs the same generator at any size.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.hostile_http import HostileHTTP, HostileRequest, HostileResponse, problem, run
from bench.hostile_upstream import HostileUpstream
from proxy.app import create_app
from proxy.config import Settings
from tests.helpers import LiveServer

KEYS = ["sk-acme-fuzz", "sk-globex-fuzz"]
ADMIN = "admin-fuzz"
AUTH = {"authorization": f"Bearer {KEYS[0]}"}


@pytest.fixture(scope="module")
def target() -> Iterator[LiveServer]:
    upstream = HostileUpstream(lenient=True).start()
    settings_ = Settings(
        upstream=upstream.url,
        tenants=[{"name": "acme", "api_key": KEYS[0]}, {"name": "globex", "api_key": KEYS[1]}],
        admin_api_key=ADMIN,
        budget={"session_tokens_per_window": 10**9},
    )
    server = LiveServer(create_app(settings_)).start()
    yield server
    server.stop()
    upstream.stop()


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("seed", [1, 2])
def test_hostile_http(target: LiveServer, caplog: pytest.LogCaptureFixture, seed: int) -> None:
    """Every route and method, wrong types, deep nesting, huge strings and headers, lone
    surrogates, invalid UTF-8, NaN, numbers as strings and floats, paths with control characters
    and other tails, every generation route, upstreams that answer garbage or cut their streams
    (bench/hostile_http.py)."""
    report = run("127.0.0.1", target.port, HostileHTTP(seed, KEYS, ADMIN).requests(1500), workers=4)
    print(report.summary())
    assert report.problems == []
    # Only a request naming a failing upstream behaviour may get a 5xx: that upstream's, 502 or 504.
    assert {status for status in report.statuses if status >= 500} <= {502, 504}
    # The generator does reach past validation, and does get refused for what it sends.
    assert report.statuses[200] > 50 and report.statuses[400] > 150
    assert errors_logged(caplog) == []


def test_the_checker_catches_what_it_must() -> None:
    """The fuzz assertions can fail: a 500, a FastAPI-shaped 422 and a plain-text 404 are caught."""
    post = HostileRequest("POST", b"/v1/chat/completions", [], b"{}", "json")
    json_type = {"content-type": "application/json"}
    assert problem(post, HostileResponse(500, json_type, b"{}"))
    assert problem(post, HostileResponse(422, json_type, b'{"detail": []}'))
    assert problem(post, HostileResponse(404, {"content-type": "text/plain"}, b"Not Found"))
    ok = b'{"error": {"message": "m", "type": "t", "param": null, "code": null}}'
    assert problem(post, HostileResponse(400, json_type, ok)) is None


# -- hypothesis: arbitrary JSON in every field of a chat request ------------------------------------

leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(st.characters(codec=None), max_size=30)  # lone surrogates included
)
json_values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | json_values},
    optional={
        "content": st.text(max_size=40) | json_values,
        "tool_calls": json_values
        | st.lists(
            st.fixed_dictionaries(
                {
                    "id": json_values,
                    "function": json_values | st.fixed_dictionaries({"name": json_values, "arguments": json_values}),
                }
            ),
            max_size=2,
        ),
        "name": json_values,
        "tool_call_id": json_values,
    },
)
chat_bodies = st.fixed_dictionaries(
    {"model": st.just("fake-model") | json_values, "messages": st.lists(message, min_size=1, max_size=4) | json_values},
    optional={
        "tools": json_values
        | st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": json_values}), max_size=2),
        "tool_choice": json_values,
        "stream": st.booleans() | json_values,
        "stream_options": json_values,
        "max_tokens": json_values,
        "response_format": json_values,
        "prompt_cache_key": json_values,
        "user": json_values,
        "cache_salt": json_values,
    },
)


def _encode(body: Any) -> bytes:
    # allow_nan: NaN and Infinity literals; ensure_ascii: lone surrogates as \ud800 escapes.
    return json.dumps(body, allow_nan=True).encode()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=chat_bodies, session=st.booleans())
def test_any_chat_body_is_answered_below_500_in_openai_shape(
    target: LiveServer, body: dict[str, Any], session: bool
) -> None:
    headers = {**AUTH, "content-type": "application/json"}
    if session:
        headers["x-session-id"] = "hypothesis"
    response = httpx.post(target.url + "/v1/chat/completions", content=_encode(body), headers=headers, timeout=30)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
    else:
        assert response.headers["content-type"].startswith(("application/json", "text/event-stream"))
