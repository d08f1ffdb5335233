"""Shortcuts on the per-request path must not change what is forwarded."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

import httpx
import pytest
import xxhash
from cachetools import LRUCache
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.app import create_app
from proxy.backends.transport import read_all
from proxy.backends.upstream import Upstream
from proxy.canon.normalize import MEMO_MIN_CHARS, NormalTextMemo, normalize_text
from proxy.canon.toolcalls import call_key
from proxy.config import Settings
from proxy.http.body import _valid_message, _valid_tool, _validate_message, _validate_tool, parse_json_object
from proxy.http.direct import DirectRequest
from proxy.http.errors import InvalidRequest
from proxy.ids import unique_id
from proxy.observability import digests
from proxy.observability.digests import content_text
from proxy.openai import canonical_arguments, dumps_body, jsonio, link_hash, message_fingerprint, message_text
from proxy.openai.jsonio import MAX_DEPTH, TooDeep, check_depth, dumps, loads
from proxy.recent import LastWritten, RecentMap, RecentSet, peek
from proxy.routes.forward import AfterSending
from testbed.serving import LiveServer, json_post_scope
from tests.redis_server import SHARED_URL

LINE = st.text(alphabet=st.sampled_from("ab é\u0065\u0301\t\r\n"), max_size=60)


@given(st.lists(LINE, min_size=1, max_size=80), st.booleans(), st.booleans())
def test_memo_gives_what_normalize_text_gives(lines: list[str], whitespace: bool, unicode: bool) -> None:
    text = "\n".join(lines) * (MEMO_MIN_CHARS // 20 + 1)
    memo = NormalTextMemo()
    expected = normalize_text(text, whitespace=whitespace, unicode=unicode)
    for _ in range(2):  # the second pass answers from the memo
        assert memo.normalize(text, whitespace=whitespace, unicode=unicode) == expected
        assert memo.normalize(expected, whitespace=whitespace, unicode=unicode) == expected


def test_memo_is_keyed_by_the_options() -> None:
    text = "line with a trailing blank \n" * 200
    memo = NormalTextMemo()
    assert memo.normalize(text, whitespace=False, unicode=True) == text
    assert memo.normalize(text, whitespace=True, unicode=True) == "line with a trailing blank\n" * 200


def test_single_line_text_with_inner_blanks_is_unchanged() -> None:
    text = "word  " * 5000 + "end"
    assert normalize_text(text, whitespace=True, unicode=True) is text


def test_loads_accepts_what_the_standard_library_accepts() -> None:
    assert loads(b'{"a": NaN}')["a"] != loads(b'{"a": NaN}')["a"]  # NaN, as json gives it
    assert loads(b'{"t": "\\ud800x"}') == {"t": "\ud800x"}
    assert loads('{"k": [1, 2.5, "\u00e9"]}') == {"k": [1, 2.5, "é"]}
    try:
        loads(b"{not json")
    except ValueError as exc:
        assert "Expecting property name" in str(exc)
    else:
        raise AssertionError("invalid JSON was accepted")


def test_dumps_keeps_lone_surrogates_as_valid_json() -> None:
    raw = dumps({"t": "\ud800", "u": "é"})
    assert json.loads(raw.decode("utf-8")) == {"t": "\ud800", "u": "é"}
    assert dumps({"u": "é", "n": 1}) == '{"u":"é","n":1}'.encode()


async def test_upstream_keeps_no_cookies_between_requests() -> None:
    """One client serves every tenant: an upstream cookie must not reach the next request."""
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("cookie"))
        return httpx.Response(200, json={}, headers={"set-cookie": "session=tenant-a; Path=/"})

    upstream = Upstream("http://upstream.test/v1", transport=httpx.MockTransport(handler))
    try:
        for _ in range(2):
            response = await upstream.open("POST", "/chat/completions", content=b"{}")
            await upstream.read(response)
    finally:
        await upstream.aclose()
    assert seen == [None, None]


def test_the_default_transport_keeps_no_cookies_of_a_named_upstream_host() -> None:
    """aiohttp keeps the cookies of named hosts (not of IP addresses) unless told not to."""
    seen: list[str | None] = []

    async def app(request: Request) -> Response:
        seen.append(request.headers.get("cookie"))
        return JSONResponse({}, headers={"set-cookie": "session=tenant-a; Path=/"})

    async def two_requests(url: str) -> None:
        upstream = Upstream(url)
        try:
            for _ in range(2):
                await upstream.read(await upstream.open("POST", "/chat/completions", content=b"{}"))
        finally:
            await upstream.aclose()

    with LiveServer(Starlette(routes=[Route("/v1/chat/completions", app, methods=["POST"])])) as server:
        asyncio.run(two_requests(f"http://localhost:{server.port}/v1"))
    assert seen == [None, None]


def test_whole_bodies_are_read_in_one_call_and_encoded_ones_still_decoded() -> None:
    """The default transport reads an identity body whole from aiohttp; a gzip-encoded one still goes
    through httpx's decoder (the proxy relays what it read, without the encoding header)."""
    answer = json.dumps({"id": "x", "text": "é" * 3000}).encode()

    async def app(request: Request) -> Response:
        if request.query_params.get("gzip"):
            return Response(gzip.compress(answer), media_type="application/json", headers={"content-encoding": "gzip"})
        return Response(answer, media_type="application/json")

    async def read_both(url: str) -> list[bytes]:
        upstream = Upstream(url)
        try:
            plain = await upstream.open("POST", "/chat/completions", content=b"{}")
            assert read_all(plain) is not None  # the transport's one-call read
            encoded = await upstream.open("POST", "/chat/completions?gzip=1", content=b"{}")
            return [await upstream.read(plain), await upstream.read(encoded)]
        finally:
            await upstream.aclose()

    with LiveServer(Starlette(routes=[Route("/v1/chat/completions", app, methods=["POST"])])) as server:
        assert asyncio.run(read_both(f"http://127.0.0.1:{server.port}/v1")) == [answer, answer]


def test_recent_set_drops_the_least_recently_used() -> None:
    recent: RecentSet[str] = RecentSet(2)
    assert recent.add("a") is False
    recent.add("b")
    assert recent.touch("a") is True  # "b" is now the oldest
    assert recent.add("c") is False
    assert "b" not in recent
    assert "a" in recent and "c" in recent
    assert recent.add("a") is True
    recent.discard("a")
    assert "a" not in recent and len(recent) == 1


def test_recent_map_drops_the_least_recently_used_and_peek_is_no_use() -> None:
    recent: RecentMap[str, int] = RecentMap(2)
    recent["a"] = 1
    recent["b"] = 2
    assert recent.peek("a") == 1  # not a use: "a" stays the oldest
    recent["c"] = 3
    assert "a" not in recent and recent.get("a") is None
    assert recent.get("b") == 2  # a use: "c" is now the oldest
    recent["d"] = 4
    assert "c" not in recent and recent.peek("b") == 2 and recent.peek("d") == 4 and len(recent) == 2
    recent["b"] = 5  # a write is a use too
    recent["e"] = 6
    assert "d" not in recent and recent.get("b") == 5


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_the_next_request_always_finds_the_turn_recorded(fake_backend: LiveServer, store: str) -> None:
    """An in-process store records a turn once the answer is sent (the client does not wait for it)
    but before the event loop serves anything else; a shared store, before the answer is released."""
    sessions = {"store": store, "redis_url": SHARED_URL, "key_prefix": f"pp-order-{unique_id()}:"}
    app = create_app(Settings(upstream=fake_backend.url + "/v1", sessions=sessions))
    events: list[str] = []
    async with app.router.lifespan_context(app):
        store_object = app.state.proxy.sessions.store
        record_turn = store_object.record_turn

        async def recording(*args: Any, **kwargs: Any) -> None:
            await record_turn(*args, **kwargs)
            events.append("recorded")

        store_object.record_turn = recording
        body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
        scope = json_post_scope("/v1/chat/completions", body)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                events.append("answer sent")
                # The next thing the event loop would serve (the client's next request, say).
                asyncio.get_running_loop().call_soon(events.append, "loop served something else")

        await app(scope, receive, send)
    if store == "memory":
        assert events == ["answer sent", "recorded", "loop served something else"]
    else:
        assert events == ["recorded", "answer sent", "loop served something else"]


def test_idle_upstream_connections_are_dropped_before_the_backend_drops_them() -> None:
    """A connection idle past ``keepalive_s`` is not reused: the proxy never writes a request on a
    connection the backend (uvicorn: 5 s of idleness) may be closing at that moment."""
    ports: list[int] = []

    async def app(request: Request) -> Response:
        assert request.client is not None
        ports.append(request.client.port)
        return JSONResponse({})

    async def requests(url: str) -> None:
        # Wide enough that a loaded machine does not take the first two requests for idle ones.
        upstream = Upstream(url, keepalive_s=1.0)
        try:
            for pause in (0.0, 0.0, 1.5):
                await asyncio.sleep(pause)
                await upstream.read(await upstream.open("POST", "/chat/completions", content=b"{}"))
        finally:
            await upstream.aclose()

    with LiveServer(Starlette(routes=[Route("/v1/chat/completions", app, methods=["POST"])])) as server:
        asyncio.run(requests(f"http://127.0.0.1:{server.port}/v1"))
    assert ports[0] == ports[1] != ports[2]


async def test_every_step_after_sending_runs_though_one_fails() -> None:
    done: list[str] = []

    async def failing() -> None:
        done.append("session")
        raise RuntimeError("store down")

    def account() -> None:
        done.append("metrics")

    response = Response(b"{}", background=AfterSending(failing, account))
    assert response.background is not None
    with pytest.raises(RuntimeError, match="store down"):
        await response.background()
    assert done == ["session", "metrics"]


def test_direct_request_headers_read_as_starlettes() -> None:
    raw = [(b"content-type", b"application/json"), (b"x-session-id", b"a"), (b"x-session-id", b"b")]
    scope = {"type": "http", "method": "POST", "path": "/", "headers": raw}
    ours, theirs = DirectRequest(scope).headers, Request(scope).headers
    for name in ("Content-Type", "x-session-id", "X-SESSION-ID", "authorization"):
        assert ours.get(name) == theirs.get(name)
    assert ours.get("authorization", "none") == "none"
    assert list(ours.items()) == list(theirs.items())


@given(
    st.recursive(
        st.none() | st.integers(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3),
        max_leaves=40,
    ),
    st.integers(1, 8),
)
def test_depth_check_refuses_exactly_what_nests_deeper(value: Any, limit: int) -> None:
    def depth(item: Any) -> int:
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        return 0 if children is None else 1 + max((depth(child) for child in children), default=0)

    if depth(value) > limit:
        with pytest.raises(TooDeep):
            check_depth(value, limit)
    else:
        check_depth(value, limit)


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def _body_with_tool_depth(levels: int, name: str = "f") -> bytes:
    """A chat body whose tool list nests ``levels`` levels (the body itself one more)."""
    parameters = _nested(levels - 3)  # under the list, a tool and its function
    tool = {"type": "function", "function": {"name": name, "parameters": parameters}}
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}).encode()


def test_a_tool_list_is_walked_once_per_tenant_and_list(monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[int] = []
    original = jsonio.check_depth

    def counted(value: Any, max_depth: int = MAX_DEPTH) -> None:
        walked.append(max_depth)
        original(value, max_depth)

    monkeypatch.setattr(jsonio, "check_depth", counted)
    monkeypatch.setattr(jsonio, "_WITHIN_BOUND", type(jsonio._WITHIN_BOUND)(16))
    body = _body_with_tool_depth(20)
    for _ in range(3):
        parse_json_object(body, "tenant-a")
    assert walked == [MAX_DEPTH - 1]  # the tools once; the rest of the body is not the memo's
    parse_json_object(body, "tenant-b")  # another tenant's first time is walked too
    parse_json_object(_body_with_tool_depth(20, "g"), "tenant-a")  # and another list
    assert walked == [MAX_DEPTH - 1] * 3


@pytest.mark.parametrize("namespace", [None, "tenant-a"])
def test_the_tool_lists_depth_bound_is_the_bodys_with_or_without_the_memo(namespace: str | None) -> None:
    parse_json_object(_body_with_tool_depth(MAX_DEPTH - 1), namespace)  # the body: MAX_DEPTH levels
    for _ in range(2):  # refused again: a list past the bound is never remembered
        with pytest.raises(InvalidRequest, match="nests deeper"):
            parse_json_object(_body_with_tool_depth(MAX_DEPTH), namespace)
    with pytest.raises(InvalidRequest, match="nests deeper"):  # past orjson's 254 levels: walked
        parse_json_object(_body_with_tool_depth(300), namespace)
    surrogate = _body_with_tool_depth(MAX_DEPTH).replace(b'"f"', b'"\\ud800"')  # orjson cannot write it
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="nests deeper"):
            parse_json_object(surrogate, namespace)


def test_a_lists_json_is_made_once_and_afresh_when_its_items_change() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    first = jsonio.shared_json(tools)
    assert first == dumps(tools)
    assert jsonio.shared_json(tools) is first  # the same list: the same bytes, not written again
    assert jsonio.shared_json(list(tools)) is not first  # another list is its own
    tools.append({"type": "function", "function": {"name": "g"}})
    assert jsonio.shared_json(tools) == dumps(tools)
    tools[0] = {"type": "function", "function": {"name": "h"}}
    assert jsonio.shared_json(tools) == dumps(tools)
    tools.reverse()
    assert jsonio.shared_json(tools) == dumps(tools)


@given(
    st.lists(st.dictionaries(st.sampled_from(["name", "type", "description"]), st.text(max_size=4)), max_size=4),
    st.text(max_size=4),
    st.booleans(),
)
def test_a_body_is_written_with_its_shared_tool_list_as_without(tools: list[Any], text: str, stream: bool) -> None:
    body = {"model": "m", "tools": tools, "messages": [{"role": "user", "content": text}], "stream": stream}
    jsonio.shared_json(tools)
    assert dumps_body(body) == dumps(body)  # lone surrogates included: dumps' own fallback
    assert jsonio.shared_dumps(tools) == dumps(tools)


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_a_chain_link_is_the_hash_of_the_two_as_little_endian_bytes(previous: int, current: int) -> None:
    # The value other replicas (and earlier releases) compute: chains are shared through Redis.
    expected = xxhash.xxh3_64_intdigest(previous.to_bytes(8, "little") + current.to_bytes(8, "little"))
    assert link_hash(previous, current) == expected


def _reference_fingerprint(message: dict[str, Any]) -> int:
    """message_fingerprint as it was first written (streamed piece by piece): its values are stored."""
    digest = xxhash.xxh3_64()
    digest.update(str(message.get("role", "")).encode("utf-8", "surrogatepass"))
    digest.update(b"\x00")
    content = message.get("content")
    text = content if isinstance(content, str) else message_text({"content": content})
    digest.update(text.encode("utf-8", "surrogatepass"))
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            function = call["function"]
            digest.update(b"\x01" + str(function.get("name", "")).encode("utf-8", "surrogatepass"))
            digest.update(canonical_arguments(function.get("arguments", "")).encode("utf-8", "surrogatepass"))
    return digest.intdigest()


def _reference_message_hash(message: dict[str, Any]) -> tuple[int, int]:
    """digests.message_hash as it was first written (streamed)."""
    content = message.get("content")
    text = (content if isinstance(content, str) else content_text(content)).encode("utf-8", "surrogatepass")
    digest = xxhash.xxh3_64(str(message.get("role")).encode("utf-8", "surrogatepass") + b"\x00")
    digest.update(text)
    size = len(text)
    calls = message.get("tool_calls")
    if calls and isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            function = function if isinstance(function, dict) else {}
            name = str(function.get("name", "")).encode("utf-8", "surrogatepass")
            arguments = digests._arguments(function.get("arguments"))
            digest.update(b"\x01" + name + b"\x00" + arguments)
            size += len(name) + len(arguments)
    return digest.intdigest(), size


TEXTS = st.text(max_size=6) | st.builds(lambda n: "long line\n" * n, st.integers(400, 500))


@given(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "system"]) | st.none()},
        optional={
            "content": TEXTS | st.none() | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXTS})),
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {"id": st.text(max_size=3), "function": st.fixed_dictionaries({"name": TEXTS, "arguments": TEXTS})}
                ),
                max_size=2,
            ),
        },
    )
)
def test_message_identities_are_the_values_they_always_were(message: dict[str, Any]) -> None:
    # Session fingerprints are kept in the shared store across releases; digests name prompts.
    assert message_fingerprint(message) == _reference_fingerprint(message)
    assert digests.message_hash(message) == _reference_message_hash(message)


@given(st.lists(st.lists(st.integers(0, 9), max_size=5), max_size=12), st.integers(1, 6))
def test_last_written_forgets_as_a_write_ordered_lru_cache(batches: list[list[int]], size: int) -> None:
    ours: LastWritten[int, int] = LastWritten(size)
    reference: LRUCache[int, int] = LRUCache(size)
    for number, keys in enumerate(batches):
        ours.write(keys, number)
        for key in keys:
            reference[key] = number
        for key in range(10):  # reads are no use to either
            assert (key in ours, ours.get(key)) == (key in reference, peek(reference, key))
    assert len(ours) == len(reference)


@given(st.text(max_size=4), st.integers(0, 2**64 - 1), st.integers(0, 9), st.integers(0, 3), st.text(max_size=4), TEXTS)
def test_a_tool_calls_key_is_the_value_it_always_was(
    namespace: str, anchor: int, ordinal: int, index: int, name: str, arguments: str
) -> None:
    # Remembered calls are found again by it, across replicas and releases.
    digest = xxhash.xxh3_64()
    for part in (namespace, str(anchor), str(ordinal), str(index), name, canonical_arguments(arguments)):
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    assert call_key(namespace, anchor, ordinal, index, name, arguments) == digest.intdigest()


MESSAGE_VALUES = st.none() | st.booleans() | st.integers() | st.text(max_size=3) | st.lists(st.none(), max_size=1)
PARTS = st.lists(
    st.dictionaries(st.sampled_from(["type", "text"]), MESSAGE_VALUES | st.just("text"), max_size=2), max_size=2
)
FUNCTIONS = st.dictionaries(
    st.sampled_from(["name", "arguments", "parameters"]), MESSAGE_VALUES | st.dictionaries(st.just("a"), st.none())
)
CALLS = st.lists(
    st.none() | st.dictionaries(st.sampled_from(["id", "type", "function"]), MESSAGE_VALUES | FUNCTIONS), max_size=2
)


def _verdict(check: Any, *args: Any) -> bool:
    try:
        check(*args)
    except InvalidRequest:
        return False
    return True


@given(
    st.dictionaries(
        st.sampled_from(["role", "content", "name", "tool_call_id", "tool_calls", "function_call", "extra"]),
        MESSAGE_VALUES | st.sampled_from(["user", "assistant", "tool", "bogus"]) | PARTS | CALLS | FUNCTIONS,
    )
)
def test_the_message_shortcut_agrees_with_the_full_check(message: dict[str, Any]) -> None:
    assert _valid_message(message) == _verdict(_validate_message, message, "messages[0]")


@given(
    st.none()
    | st.integers()
    | st.dictionaries(st.sampled_from(["type", "function", "name", "parameters"]), MESSAGE_VALUES | FUNCTIONS)
)
def test_the_tool_shortcut_agrees_with_the_full_check(tool: Any) -> None:
    assert _valid_tool(tool) == _verdict(_validate_tool, tool, "tools[0]")


ROLES = st.one_of(st.sampled_from(["system", "user", "developer"]), st.integers(0, 2), st.booleans(), st.floats(0, 2))


@given(
    asked=st.lists(
        st.tuples(
            ROLES,
            st.sampled_from(["role", "content"]),
            st.one_of(st.none(), st.just([]), st.just([{"function": {"name": "f", "arguments": "{}"}}])),
        ),
        min_size=2,
        max_size=5,
    )
)
def test_a_long_texts_digests_kept_by_the_string_equal_the_digests_made_afresh(
    asked: list[tuple[Any, str, Any]],
) -> None:
    """The layout's message digest and the miss explanation's message hash keep a long text's
    result by the string's identity: asked again with the same string under another role (``1``,
    ``1.0`` and ``True`` are equal, their JSON is not), key order or tool calls, each still equals
    its definition (orjson's bytes hashed; the role's prefix and the UTF-8 text hashed)."""
    from proxy.canon.layout import message_digest
    from proxy.openai import LONG_TEXT_CHARS, role_prefix

    text = "第一行\n" + "x" * LONG_TEXT_CHARS
    raw = text.encode()
    for role, first, calls in asked:
        message = {"role": role, "content": text} if first == "role" else {"content": text, "role": role}
        if calls is not None:
            message["tool_calls"] = calls
        assert message_digest(message) == xxhash.xxh3_64_intdigest(dumps(message))
        if not calls:
            assert digests.message_hash(message) == (xxhash.xxh3_64_intdigest(role_prefix(role) + raw), len(raw))


def test_by_text_finds_a_value_by_the_strings_identity_within_a_bound_of_characters() -> None:
    from proxy.openai import ByText

    memo: ByText[int] = ByText(max_chars=100)
    first, second = "a" * 40, "b" * 40
    memo.put(first, "system", 1)
    assert memo.get(first, "system") == 1
    assert memo.get("".join(["a"] * 40), "system") is None  # an equal string, not this one
    assert memo.get(first, "user") is None  # what else the value depends on differs
    memo.put(second, "system", 2)
    memo.put("c" * 40, "system", 3)  # 120 characters held would be past the bound: the oldest goes
    assert memo.get(first, "system") is None and memo.get(second, "system") == 2
    memo.put("d" * 100, "system", 4)  # as large as the whole bound: not kept, nothing forgotten for it
    assert memo.get("d" * 100, "system") is None and memo.get(second, "system") == 2
