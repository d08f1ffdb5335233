"""Streams as engines send them, which the relays misread before (a review); each test failed before
its fix. The end of a stream is an event's field, never words the model wrote; an error event of the
engine's own ends the answer unfinished, whatever follows it; ``data:`` without its space, an encoded
body and llama-server's ``event: error`` are read as SSE reads them. The double: tests/stream_upstream.py."""

from __future__ import annotations

import json
import time
import zlib

import httpx
import pytest

from tests.stream_upstream import (
    BUDGET,
    RESET,
    SCRIPTS,
    USAGE,
    chunk,
    data,
    ev,
    msg_stream,
    new_session,
    responses_stream,
    session_state,
    sse_events,
    text_block,
    tool_block,
    vllm_chat,
)


def slow(events):  # one event per TCP read, as an engine writes them token by token
    return [x for e in events for x in (e, 0.02)]


def post(stream_proxy, route, model, session, **extra):
    msgs = [{"role": "user", "content": "hi"}]
    body = {
        "chat": {"model": model, "messages": msgs, "max_tokens": 50},
        "messages": {"model": model, "messages": msgs, "max_tokens": 50},
        "responses": {"model": model, "input": "hi", "max_output_tokens": 50},
    }[route]
    path = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}[route]
    return httpx.post(
        stream_proxy.url + path, json={**body, "stream": True, **extra}, headers={"x-session-id": session}, timeout=30
    )


# 1. The end of a stream is found by a substring anywhere in the event bytes, JSON strings included.
ARGS = {
    "path": "server.py",
    "content": "yield 'data: [DONE]\\n\\n'  # event: message_stop / event: response.completed\n",
}
TOOL = [
    {"index": 0, "id": "call_1", "type": "function", "function": {"name": "write_file", "arguments": json.dumps(ARGS)}}
]
SCRIPTS["end-in-chat-tool"] = lambda b: slow(
    [  # Ollama: a tool call arrives whole, in one chunk
        data(chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}])),
        data(chunk(tool=TOOL)),
        data(chunk(finish="tool_calls")),
        data(chunk(choices=[], usage=USAGE)),
        b"data: [DONE]\n\n",
    ]
)
SCRIPTS["end-in-anthropic-tool"] = lambda b: slow(msg_stream(tool_block(ARGS)))
SCRIPTS["end-in-responses-text"] = lambda b: slow(
    responses_stream("A Responses stream ends with `event: response.completed`.")
)  # response.output_text.done holds the whole text


@pytest.mark.parametrize(
    ("route", "model"),
    [("chat", "end-in-chat-tool"), ("messages", "end-in-anthropic-tool"), ("responses", "end-in-responses-text")],
)
def test_end_marker_inside_model_output_does_not_end_the_answer(stream_proxy, route, model):
    s = new_session()
    r = post(stream_proxy, route, model, s)
    assert r.status_code == 200
    state = session_state(stream_proxy, r, s)
    # Every script reports 20 prompt + 3 completion tokens at its real end.
    assert state["completion_tokens"] == 3, state
    assert state["budget_left"]["session"] == BUDGET - 23, state


# 2. vLLM's mid-stream error is followed by [DONE] (serving_chat.py: error event, then "data: [DONE]").
VLLM_ERR = {
    "error": {
        "message": "Expecting ',' delimiter: line 1 column 12",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}
SCRIPTS["vllm-error-then-done"] = lambda b: [*vllm_chat(["Hel", "lo"])[:3], data(VLLM_ERR), b"data: [DONE]\n\n"]


def test_vllm_error_then_done_is_not_an_answered_turn(stream_proxy):
    s = new_session()
    r = post(stream_proxy, "chat", "vllm-error-then-done", s)
    assert sse_events(r.text)[-2][1].startswith('{"error"')  # the client got the error (its SDK raises)
    time.sleep(0.5)
    got = httpx.get(
        f"{stream_proxy.url}/v1/sessions/{r.headers['x-prefix-proxy-session']}", headers={"x-session-id": s}
    )
    # As for a stream that breaks (no turn recorded, charged prompt + relayed tokens), not a finished turn
    # charged its whole reservation (~588 tokens here for ~22 spent).
    assert got.status_code == 404, got.json()


# 3. `data:` without the optional space (WHATWG SSE: "If value starts with a U+0020 SPACE, remove it").
SCRIPTS["no-space"] = lambda b: [p.replace(b"data: ", b"data:") for p in vllm_chat(["Hel", "lo", "!"])]


def test_data_without_space(stream_proxy):
    s = new_session()
    r = post(stream_proxy, "chat", "no-space", s)
    events = sse_events(r.text)
    assert events[-1][1] == "[DONE]", events[-1]  # was: an upstream_stream_truncated error after [DONE]
    assert not any('"usage"' in d for _, d in events)  # the client did not ask for usage
    assert session_state(stream_proxy, r, s)["budget_left"]["session"] == BUDGET - 23


# 4. The proxy asks for gzip (aiohttp's default Accept-Encoding) but relays a stream's raw bytes.
def _gzip(body):
    c = zlib.compressobj(wbits=31)
    return [
        {"content-encoding": "gzip"},
        *(c.compress(p) + c.flush(zlib.Z_SYNC_FLUSH) for p in vllm_chat(["Hel", "lo", "!"])),
        c.flush(),
    ]


SCRIPTS["gzip"] = _gzip


def test_gzip_encoded_stream(stream_proxy):
    r = post(stream_proxy, "chat", "gzip", new_session())
    text = "".join(
        json.loads(d)["choices"][0]["delta"].get("content") or ""
        for _, d in sse_events(r.text)
        if d.startswith("{") and json.loads(d).get("choices")
    )
    assert text == "Hello!", r.text


# 5. llama-server's Anthropic mid-stream error: format_anthropic_sse({event: error, data: format_error_response(...)}).
LLAMA_ERR = (
    b'event: error\ndata: {"code":500,"message":"Input prompt is too big compared to KV size.",'
    b'"type":"server_error"}\n\n'
)
SCRIPTS["llama-anthropic-error"] = lambda b: slow(
    [
        *msg_stream([], err=LLAMA_ERR)[:1],
        ev(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        LLAMA_ERR,
    ]
)


def _invalid_responses(stream_proxy):
    for line in httpx.get(stream_proxy.url + "/metrics").text.splitlines():
        if line.startswith('prefix_proxy_upstream_errors_total{kind="invalid_response",route="messages"}'):
            return float(line.split()[-1])
    return 0.0


def test_llama_server_anthropic_error_event_is_the_upstreams_error(stream_proxy):
    before = _invalid_responses(stream_proxy)
    r = post(stream_proxy, "messages", "llama-anthropic-error", new_session())
    errors = [d for name, d in sse_events(r.text) if name == "error"]
    assert len(errors) == 1, errors  # was: llama's error, then the proxy's "stream ended before the answer did"
    assert _invalid_responses(stream_proxy) == before  # was: counted as a protocol failure (and answer_unusable)


# 6. An Anthropic stream cut short: message_start reports the prompt and no output yet (a real llama-server
#    killed mid-answer, a review): that report was charged as the answer's whole usage, the output relayed
#    before the cut free. Charged as a chat stream cut short is: at least what the events relayed carried.
SCRIPTS["m-cut"] = lambda b: slow([*msg_stream(text_block(["Once", " upon", " a"]))[:5], 0.05, RESET])
SCRIPTS["m-whole"] = lambda b: slow(msg_stream(text_block(["Hel", "lo", "!"])))


def test_an_anthropic_stream_cut_short_is_charged_what_it_relayed(stream_proxy):
    s = new_session()
    cut = post(stream_proxy, "messages", "m-cut", s)
    assert '"Once"' in cut.text
    whole = post(stream_proxy, "messages", "m-whole", s)
    left = session_state(stream_proxy, whole, s)["budget_left"]["session"]
    charged_for_the_cut = BUDGET - 23 - left  # the whole answer: 20 in, 3 out
    assert 20 + 3 <= charged_for_the_cut <= 20 + 10, charged_for_the_cut
