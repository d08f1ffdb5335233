"""A body parsed from the runs of the tenant's last bodies (``proxy.openai.resumedjson``): the same
value as parsing it whole, whatever the bodies before it were; only what is new parsed; the body
written upstream the same bytes as writing it whole."""

from __future__ import annotations

import asyncio
import itertools
import json
import types
from contextlib import ExitStack
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Receive, Scope, Send

from proxy.app import create_app
from proxy.config import Settings
from proxy.openai import dumps_body, resumedjson
from proxy.openai.jsonio import TooDeep, dumps, loads
from testbed.fakevllm import FakeBackendConfig, openai_responses, responses
from testbed.fakevllm import create_app as create_fake_backend
from testbed.serving import serve_in_thread
from testbed.workload import run_workload_async


@pytest.fixture(autouse=True)
def small_bodies(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every body is resumed (not only those past 96 KiB): the tests' bodies are small.
    monkeypatch.setattr(resumedjson, "MIN_BYTES", 0)
    monkeypatch.setattr(resumedjson, "MIN_HISTORY_BYTES", 0)
    monkeypatch.setattr(resumedjson, "MIN_VALUE_CHARS", 1)  # a value before the array skipped by its text
    resumedjson.forget()


def _message(role: str, text: str, index: int) -> dict[str, Any]:
    if role == "assistant" and index % 3 == 0:
        call = {"id": f"call_{index}", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        return {"role": role, "content": None, "tool_calls": [call]}
    if role == "user" and index % 4 == 0:
        return {"role": role, "content": [{"type": "text", "text": text}]}
    return {"role": role, "content": text}


def _serialize(body: dict[str, Any], style: int) -> bytes:
    if style == 0:
        return json.dumps(body).encode()  # Python clients: spaces, \\u escapes
    if style == 1:
        return orjson.dumps(body)  # compact, UTF-8 (JavaScript's JSON.stringify)
    if style == 2:
        return json.dumps(body, indent=2, ensure_ascii=False).encode()
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def _expected(raw: bytes) -> Any:
    return loads(raw)


texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)


@st.composite
def conversations(draw: st.DrawFn) -> list[bytes]:
    """A conversation's bodies as a client sends them: each the last plus a reply and a question,
    or with an edit, a window slid, a system prompt changed, a retry, another key order."""
    style = draw(st.integers(0, 3))
    system = draw(texts)
    messages: list[dict[str, Any]] = []
    bodies = []
    for turn in range(draw(st.integers(1, 9))):
        step = draw(st.sampled_from(["append", "append", "append", "edit", "slide", "system", "retry", "keys"]))
        if step == "edit" and messages:
            at = draw(st.integers(0, len(messages) - 1))
            messages[at] = _message(messages[at]["role"], draw(texts), at)
        elif step == "slide" and len(messages) > 2:
            messages = messages[2:]
        elif step == "system":
            system = draw(texts)
        if step != "retry" or not messages:
            if messages:
                messages.append(_message("assistant", draw(texts), len(messages)))
            messages.append(_message("user", draw(texts), len(messages)))
        body: dict[str, Any] = {"messages": [{"role": "system", "content": system}, *messages]}
        tools = [{"type": "function", "function": {"name": "f"}}]
        extra = {"model": "m", "stream": draw(st.booleans()), "tools": tools}
        body = {**extra, **body} if step == "keys" or turn % 2 else {**body, **extra}
        bodies.append(_serialize(body, style))
    return bodies


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(conversations(), min_size=1, max_size=3), st.randoms(use_true_random=False))
def test_a_body_parses_to_what_parsing_it_whole_gives(histories: list[list[bytes]], random: Any) -> None:
    resumedjson.forget()
    # Conversations of one tenant interleaved: a run found for one must never give another's values.
    queue = [list(h) for h in histories]
    while any(queue):
        bodies = random.choice([q for q in queue if q])
        raw = bodies.pop(0)
        parsed = resumedjson.resumed_loads(raw, "tenant")
        assert parsed == _expected(raw)
        assert dumps_body(parsed) == dumps(parsed)


def _chat(turns: int, system: str = "You are a helpful assistant.\n" * 4) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}: " + "why is the sky blue? " * 5})
        messages.append({"role": "assistant", "content": f"answer {turn}: " + "Rayleigh scattering. " * 5})
    messages.append({"role": "user", "content": "and the sunset?"})
    return {"model": "m", "messages": messages}


def test_the_history_a_conversation_sent_before_is_the_same_objects_not_parsed_again() -> None:
    first = resumedjson.resumed_loads(json.dumps(_chat(10)).encode(), "t")
    second = resumedjson.resumed_loads(json.dumps(_chat(11, system="It is 10:02.\n")).encode(), "t")
    third = resumedjson.resumed_loads(json.dumps(_chat(12, system="It is 10:03.\n")).encode(), "t")
    assert second == _chat(11, system="It is 10:02.\n") and third == _chat(12, system="It is 10:03.\n")
    # The first body was parsed whole; from the second on, the history each re-sends is taken.
    assert all(a is b for a, b in zip(first["messages"][1:20], second["messages"][1:20], strict=True))
    assert all(a is b for a, b in zip(second["messages"][1:22], third["messages"][1:22], strict=True))
    assert second["messages"][0] is not first["messages"][0]  # the system prompt changed


def test_only_what_is_new_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[int] = []

    def counting_loads(raw: bytes) -> Any:
        parsed.append(len(raw))
        return orjson.loads(raw)

    counting = types.SimpleNamespace(
        loads=counting_loads, dumps=orjson.dumps, Fragment=orjson.Fragment, JSONDecodeError=orjson.JSONDecodeError
    )
    monkeypatch.setattr(resumedjson, "orjson", counting)
    sizes = []
    for turns in range(300, 306):
        raw = json.dumps(_chat(turns)).encode()
        parsed.clear()
        body = resumedjson.resumed_loads(raw, "t")
        assert body == _chat(turns)
        sizes.append((len(raw), sum(parsed)))
    # The first body is parsed whole (the second scans where its elements end, once); each next
    # one, only the system prompt, the new turn and the keys around the history.
    assert all(size > 50_000 for size, _ in sizes), sizes
    assert all(parsed < 2_000 for _, parsed in sizes[2:]), sizes


def test_another_tenant_never_gets_a_tenants_run() -> None:
    raw = json.dumps(_chat(10)).encode()
    resumedjson.resumed_loads(raw, "a")
    mine = resumedjson.resumed_loads(json.dumps(_chat(11)).encode(), "a")
    theirs = resumedjson.resumed_loads(json.dumps(_chat(11)).encode(), "b")
    assert theirs == mine
    assert not any(a is b for a, b in zip(mine["messages"], theirs["messages"], strict=True))


@pytest.mark.parametrize(
    "tail",
    [
        ', "messages": [{"role": "user", "content": "the second array"}]}',  # the key given twice
        ', "model": "m", "messages": 5}',
        ', "model": "m"}',
    ],
)
def test_a_body_that_reads_otherwise_after_the_history_is_read_as_a_whole_parse_reads_it(tail: str) -> None:
    history = _chat(10)["messages"]
    resumedjson.resumed_loads(json.dumps({"model": "m", "messages": history}).encode(), "t")
    resumedjson.resumed_loads(json.dumps({"model": "m", "messages": [*history, history[-1]]}).encode(), "t")
    raw = ('{"messages": ' + json.dumps([*history, history[-1], history[-2]]) + tail).encode()
    assert resumedjson.resumed_loads(raw, "t") == loads(raw)


def test_a_key_given_twice_never_pairs_one_arrays_text_with_the_others_values() -> None:
    history = _chat(10)["messages"]
    other = [{"role": "user", "content": f"not the history {n}"} for n in range(len(history))]
    twice = '{"messages": ' + json.dumps(history) + ', "model": "m", "messages": ' + json.dumps(other) + "}"
    assert resumedjson.resumed_loads(twice.encode(), "t")["messages"] == other
    for extra in ([history[1]], [history[1], history[2]]):
        raw = json.dumps({"messages": [*history, *extra]}).encode()
        assert resumedjson.resumed_loads(raw, "t") == loads(raw)


@pytest.mark.parametrize("differ", ["true-for-1", "key-order"])
def test_two_arrays_that_python_calls_equal_are_told_apart(differ: str) -> None:
    """Python's ``==`` takes ``true`` for ``1`` and ignores key order: a body whose array key is given
    twice, the arrays differing only so, must not have the second array's values forwarded for the
    next body's bytes (before: the next body went upstream with ``1`` where the client sent ``true``)."""
    history = _chat(10)["messages"]
    if differ == "true-for-1":
        first = [{**m, "flag": True} if n == 3 else m for n, m in enumerate(history)]
        second = [{**m, "flag": 1} if n == 3 else m for n, m in enumerate(history)]
    else:
        first = history
        second = [dict(reversed(list(m.items()))) if n == 3 else m for n, m in enumerate(history)]
    twice = '{"messages": ' + json.dumps(first) + ', "model": "m", "messages": ' + json.dumps(second) + "}"
    resumedjson.resumed_loads(twice.encode(), "t")
    raw = json.dumps({"messages": [*first, *_chat(12)["messages"][len(first) :]]}).encode()
    assert orjson.dumps(resumedjson.resumed_loads(raw, "t")) == orjson.dumps(loads(raw))


def test_a_role_of_any_json_type_is_read_as_loads_reads_it() -> None:
    # Validation, which names the parameter, comes after the parse: the parse must not fail first.
    history = _chat(10)["messages"]
    for role in (["system"], {"a": 1}, 5, None):
        raw = json.dumps({"messages": [{"role": role, "content": "x"}, *history]}).encode()
        assert resumedjson.resumed_loads(raw, "t") == loads(raw)


def test_an_element_that_goes_on_past_the_run_is_not_taken() -> None:
    # A run ending in a number: the next body's "5" goes on as "56" (no element ends there).
    numbers = [{"role": "system", "content": "s"}, *([{"role": "user", "content": "x" * 40}] * 5)]
    resumedjson.resumed_loads(json.dumps({"messages": [*numbers, 5]}).encode(), "t")
    resumedjson.resumed_loads(json.dumps({"messages": [*numbers, 5, 6]}).encode(), "t")
    raw = json.dumps({"messages": [*numbers, 56, 7]}).encode()
    assert resumedjson.resumed_loads(raw, "t") == loads(raw)
    raw = json.dumps({"messages": [*numbers, 5, 6, 7]}).encode()
    assert resumedjson.resumed_loads(raw, "t") == loads(raw)


def test_text_orjson_refuses_is_parsed_as_loads_parses_it() -> None:
    history = _chat(10)["messages"]
    resumedjson.resumed_loads(json.dumps({"messages": history}).encode(), "t")
    resumedjson.resumed_loads(json.dumps({"messages": [*history, history[1]]}).encode(), "t")
    for extra in ('{"role": "user", "content": "\\ud800"}', '{"role": "user", "content": NaN}'):
        raw = ('{"messages": ' + json.dumps([*history, history[1]])[:-1] + ", " + extra + "]}").encode()
        assert resumedjson.resumed_loads(raw, "t") == loads(raw) or raw.find(b"NaN") > 0


@pytest.mark.parametrize("depth", [900, 5000])
def test_an_element_nested_deep_is_read_as_loads_reads_it(depth: int) -> None:
    history = _chat(10)["messages"]
    resumedjson.resumed_loads(json.dumps({"messages": history}).encode(), "t")
    resumedjson.resumed_loads(json.dumps({"messages": [*history, history[1]]}).encode(), "t")
    for at in (1, len(history) + 1):  # among the elements scanned, and among those added
        nested = [*history[:at], "[" * depth + "]" * depth, *history[at:]]
        raw = json.dumps({"messages": nested}).encode().replace(b'"' + b"[" * depth, b"[" * depth)
        raw = raw.replace(b"]" * depth + b'"', b"]" * depth)
        try:
            expected = loads(raw)
        except TooDeep:
            with pytest.raises(TooDeep):
                resumedjson.resumed_loads(raw, "t")
        else:
            assert resumedjson.resumed_loads(raw, "t") == expected


def test_a_body_written_with_a_run_is_the_bytes_of_writing_it_whole() -> None:
    for turns in range(5, 9):
        body = resumedjson.resumed_loads(json.dumps(_chat(turns)).encode(), "t")
        assert dumps_body(body) == orjson.dumps(body)
        # A rewrite that replaces a message of the history (a restored tool call) or moves one.
        messages = body["messages"]
        replaced = {**body, "messages": [*messages[:3], {"role": "user", "content": "x"}, *messages[4:]]}
        assert dumps_body(replaced) == orjson.dumps(replaced)
        inserted = {**body, "messages": [messages[0], {"role": "system", "content": "y"}, *messages[1:]]}
        assert dumps_body(inserted) == orjson.dumps(inserted)
        # A block moved before the last user message: the run written but for its last element.
        moved = {**body, "messages": [*messages[:-1], {"role": "system", "content": "z"}, messages[-1]]}
        assert dumps_body(moved) == orjson.dumps(moved)
        pieces = resumedjson._array_pieces(moved["messages"])  # written from the run, not whole
        assert pieces is not None and b"[" + b",".join(pieces) + b"]" == orjson.dumps(moved["messages"])
        assert dumps_body({**body, "messages": body["messages"][:-1]}) == orjson.dumps(
            {**body, "messages": body["messages"][:-1]}
        )


def test_a_conversation_written_request_after_request_is_joined_once_from_bounded_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each request's run adds one piece to its predecessor's bytes written (nothing copied); past
    ``MAX_PIECES`` they are joined into one, and every body is still the bytes of writing it whole."""
    monkeypatch.setattr(resumedjson, "MIN_BYTES", 0)
    monkeypatch.setattr(resumedjson, "MIN_HISTORY_BYTES", 0)
    resumedjson.forget()
    most = 0
    for turns in range(3, 3 + 2 * resumedjson.MAX_PIECES + 5):
        grown = _chat(turns)
        grown["messages"][-1] = {"role": "user", "content": f"question {turns}: " + "why is the sky blue? " * 5}
        body = resumedjson.resumed_loads(json.dumps(grown).encode(), "t")
        assert dumps_body(body) == orjson.dumps(body)
        held = resumedjson._run_held(body["messages"])
        assert held is not None
        most = max(most, len(held[1].written or ()))
    assert 1 < most <= resumedjson.MAX_PIECES + 1


def _forwarded_bodies(monkeypatch: pytest.MonkeyPatch, resume_all: bool) -> tuple[list[bytes], dict[str, Any]]:
    """The bodies a prefix-proxy sends upstream for the project's workload (every shape, two
    sessions each), with every body resumed or (the defaults here) none."""
    # The fake engine's ids made the same in both runs (they are random in it, as vLLM's are).
    numbers = itertools.count()
    monkeypatch.setattr(responses, "random_id", lambda: f"{next(numbers):032x}")
    monkeypatch.setattr(openai_responses, "new_id", lambda prefix: f"{prefix}_{next(numbers):016x}")
    resumedjson.forget()
    size = 0 if resume_all else 1 << 40
    monkeypatch.setattr(resumedjson, "MIN_BYTES", size)
    monkeypatch.setattr(resumedjson, "MIN_HISTORY_BYTES", size)
    backend = create_fake_backend(FakeBackendConfig())
    received: list[bytes] = []

    async def recording(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await backend(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        received.append(b"".join(chunks))
        delivered = False

        async def replay() -> dict[str, Any]:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": received[-1], "more_body": False}

        await backend(scope, replay, send)

    with ExitStack() as stack:
        upstream = stack.enter_context(serve_in_thread(recording, name="recording-backend"))
        proxy = stack.enter_context(serve_in_thread(create_app(Settings(upstream=upstream + "/v1")), name="proxy"))
        results = asyncio.run(run_workload_async(proxy + "/v1", sessions_per_scenario=2, seed=3, concurrency=1))
    return received, {name: (r.requests, r.prompt_tokens, r.cached_tokens, r.errors) for name, r in results.items()}


def test_the_workload_through_the_proxy_is_forwarded_byte_for_byte_as_when_parsed_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed_whole, whole_results = _forwarded_bodies(monkeypatch, resume_all=False)
    spliced: list[int] = []
    original = resumedjson._splice
    monkeypatch.setattr(resumedjson, "_splice", lambda *a: spliced.append(1) or original(*a))
    resumed, resumed_results = _forwarded_bodies(monkeypatch, resume_all=True)
    assert len(spliced) > len(resumed) // 2  # most bodies resumed a run
    assert resumed_results == whole_results
    assert resumed == parsed_whole


def test_a_moved_block_before_elements_that_span_the_runs_pieces_is_written_from_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each request's new elements are a piece of the run's bytes of their own: a block moved before
    more of them than the last piece holds cuts across pieces (written from them joined)."""
    monkeypatch.setattr(resumedjson, "MIN_BYTES", 0)
    monkeypatch.setattr(resumedjson, "MIN_HISTORY_BYTES", 0)
    resumedjson.forget()
    chat = _chat(6)
    first = resumedjson.resumed_loads(json.dumps(chat).encode(), "t")
    dumps_body(first)
    # The same history and a reply, then a new question: the run continued by two elements.
    grown = {**chat, "messages": [*chat["messages"], {"role": "assistant", "content": "It is red."}]}
    grown["messages"].append({"role": "user", "content": "and at night?"})
    body = resumedjson.resumed_loads(json.dumps(grown).encode(), "t")
    dumps_body(body)
    held = resumedjson._run_held(body["messages"])
    assert held is not None and len(held[1].written or ()) == 2
    messages = body["messages"]
    for cut in (1, 2, 3):  # the last element, the whole last piece, across the two pieces
        moved = {**body, "messages": [*messages[:-cut], {"role": "system", "content": "z"}, *messages[-cut:]]}
        pieces = resumedjson._array_pieces(moved["messages"])
        assert pieces is not None, cut
        assert b"[" + b",".join(pieces) + b"]" == orjson.dumps(moved["messages"])
        assert dumps_body(moved) == orjson.dumps(moved)
