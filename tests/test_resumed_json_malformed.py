"""Bodies the resumed parse read otherwise than a whole parse (found by differential fuzzing of
``proxy.openai.resumedjson``): a missing value and an element nested past Python's recursion limit
made the scan raise (AttributeError, RecursionError) where the whole parse refuses the body or
reads it, so the client got a 500 where it gets the whole parse's answer (a 400). At the module's
real thresholds (MIN_BYTES 96 KiB): nothing is monkeypatched. Each failed before its fix."""

from __future__ import annotations

import json

import httpx
import pytest

from proxy.app import create_app
from proxy.config import Settings
from proxy.http.body import parse_json_object
from proxy.http.errors import InvalidRequest
from proxy.openai import resumedjson
from proxy.openai.jsonio import TooDeep, loads
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_backend
from testbed.serving import serve_in_thread

PAD = "p" * 100_000  # past MIN_BYTES / MIN_HISTORY_BYTES


def _same(a: object, b: object) -> bool:
    """Equal as JSON, types and key order included, without recursion (the values nest ~1000 deep)."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if type(x) is dict:
            if list(x) != list(y):  # type: ignore[call-overload]
                return False
            stack.extend(zip(x.values(), y.values(), strict=False))  # type: ignore[union-attr]
        elif type(x) is list:
            if len(x) != len(y):  # type: ignore[arg-type]
                return False
            stack.extend(zip(x, y, strict=False))  # type: ignore[call-overload]
        elif x != y:
            return False
    return True


@pytest.fixture(autouse=True)
def _fresh() -> None:
    resumedjson.forget()


# 1. _skip (resumedjson.py:226): ``_SCALAR.match(...)`` is None where a value is missing
#    (`"model": ,`, `[x,,y]`, `[x,]` with a long tail), and ``.end()`` raises AttributeError, which
#    resumed_loads (line 143) does not catch.
MALFORMED = [
    b'{"model":,"messages":[{"role":"user","content":"' + PAD.encode() + b'"}]}',
    b'{"model":"m","messages":[,{"role":"user","content":"' + PAD.encode() + b'"}]}',
    b'{"model":"m","messages":[{"role":"user","content":"a"},,{"role":"user","content":"' + PAD.encode() + b'"}]}',
]


@pytest.mark.parametrize("raw", MALFORMED, ids=["missing-value-before-array", "leading-comma", "double-comma"])
def test_a_missing_value_is_refused_as_a_whole_parse_refuses_it(raw: bytes) -> None:
    with pytest.raises(ValueError):
        loads(raw)
    with pytest.raises(ValueError):  # today: AttributeError: 'NoneType' object has no attribute 'end'
        resumedjson.resumed_loads(raw, "tenant")
    with pytest.raises(InvalidRequest):  # the 400 "request body is not valid JSON"
        parse_json_object(raw, "tenant")


def test_a_missing_value_is_answered_400_over_http_not_500() -> None:
    with (
        serve_in_thread(create_fake_backend(FakeBackendConfig())) as upstream,
        serve_in_thread(create_app(Settings(upstream=upstream + "/v1"))) as proxy,
    ):
        answer = httpx.post(
            proxy + "/v1/chat/completions",
            content=MALFORMED[0],
            headers={"content-type": "application/json"},
            timeout=30,
        )
    assert answer.status_code == 400, answer.text


# 2. _same_json (resumedjson.py:375): ``a == b`` recurses once per nesting level in CPython and
#    raises RecursionError for an element ~1000 levels deep (orjson parses up to 1024), from
#    _proven_whole (line 400) / _index (line 438), neither of which catches it. A whole parse of the
#    same body succeeds, and parse_json_object answers it 400 (TooDeep).
@pytest.mark.parametrize("depth", [1000, 1018])
def test_an_element_nested_past_the_recursion_limit_in_the_history_is_read_as_loads_reads_it(depth: int) -> None:
    deep = b"[" * depth + b"]" * depth
    user = json.dumps({"role": "user", "content": PAD}).encode()
    first = b'{"model":"m","messages":[' + user + b"," + deep + b"," + user + b"]}"
    second = b'{"model":"m","messages":[' + user + b"," + deep + b"," + user + b"," + user + b"]}"
    assert _same(resumedjson.resumed_loads(first, "tenant"), loads(first))
    assert _same(resumedjson.resumed_loads(second, "tenant"), loads(second))  # today: RecursionError
    resumedjson.forget()
    with pytest.raises(InvalidRequest):
        parse_json_object(first, "tenant")  # TooDeep, 400 (its array is kept as a run all the same)
    with pytest.raises(InvalidRequest):
        parse_json_object(second, "tenant")  # today: RecursionError (a 500), not the TooDeep 400


def test_the_whole_parse_of_the_deep_body_is_a_too_deep_error() -> None:
    deep = b"[" * 1000 + b"]" * 1000
    raw = b'{"model":"m","messages":[' + deep + b"]}"
    with pytest.raises(TooDeep):
        loads(raw, max_depth=64)
