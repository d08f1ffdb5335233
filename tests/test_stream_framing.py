"""Stream framing and failures the relays already read right (a review's checks, kept): CRLF, events
split at every byte, pings, an event without its blank line at the end, a reset mid-event in each
SDK, a client that leaves, a client that reads slowly."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from tests.stream_upstream import (
    BUDGET,
    EVENTS,
    RESET,
    SCRIPTS,
    USAGE,
    chunk,
    data,
    msg_stream,
    new_session,
    responses_stream,
    session_state,
    split_bytes,
    sse_events,
    text_block,
    vllm_chat,
)

V = lambda: vllm_chat(["Hel", "lo", "!"])  # noqa: E731
SCRIPTS["crlf"] = lambda b: [p.replace(b"\n", b"\r\n") for p in V()]
SCRIPTS["crlf-bytes"] = lambda b: [
    x for x in split_bytes([p.replace(b"\n", b"\r\n") for p in V()]) for x in (x, 0.0005)
]
SCRIPTS["bytes"] = lambda b: [x for x in split_bytes(V()) for x in (x, 0.0005)]
SCRIPTS["pings"] = lambda b: [b": ping\n\n", 0.2, b": ping\n\n", *V()[:3], b": ping\n\n", *V()[3:]]
SCRIPTS["done-unterminated"] = lambda b: [*V()[:-1], b"data: [DONE]"]


@pytest.mark.parametrize("model", ["crlf", "crlf-bytes", "bytes", "pings", "done-unterminated"])
def test_framing(stream_proxy, model):
    s = new_session()
    body = {"model": model, "stream": True, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(stream_proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": s}, timeout=30)
    events = sse_events(r.text)
    text = "".join(
        (json.loads(d)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for _, d in events
        if d.startswith("{")
    )
    assert text == "Hello!" and events[-1][1] == "[DONE]"
    assert not any("usage" in d for _, d in events)
    assert session_state(stream_proxy, r, s)["budget_left"]["session"] == BUDGET - 23


SCRIPTS["c-reset"] = lambda b: [*V()[:3], 0.05, V()[1][:20], 0.05, RESET]
SCRIPTS["m-reset"] = lambda b: (
    [*msg_stream(text_block(["Hel", "lo"]))[:3], 0.05, b'event: content_block_delta\ndata: {"ty', 0.05, RESET]
)
SCRIPTS["r-reset"] = lambda b: (
    [*responses_stream("Hello there")[:5], 0.05, b'event: response.output_text.delta\ndata: {"ty', 0.05, RESET]
)


def test_resets_raise_in_each_sdk(stream_proxy):
    oa = openai.OpenAI(base_url=stream_proxy.url + "/v1", api_key="x", max_retries=0)
    with (
        pytest.raises(openai.APIError),
        oa.chat.completions.stream(model="c-reset", messages=[{"role": "user", "content": "hi"}]) as s,
    ):
        for _ in s:
            pass
    an = anthropic.Anthropic(base_url=stream_proxy.url, api_key="x", max_retries=0)
    with (
        pytest.raises(anthropic.APIError),
        an.messages.stream(model="m-reset", max_tokens=50, messages=[{"role": "user", "content": "hi"}]) as s,
    ):
        for _ in s:
            pass
    with pytest.raises(openai.APIError), oa.responses.stream(model="r-reset", input="hi") as s:
        for _ in s:
            pass


SCRIPTS["slow-forever"] = lambda b: [x for i in range(200) for x in (data(chunk(f"t{i} ")), 0.05)]
BIG = data(chunk("x" * 60000))
SCRIPTS["flood"] = lambda b: [BIG] * 1500 + [data(chunk(choices=[], usage=USAGE)), b"data: [DONE]\n\n"]


def test_client_disconnect_closes_upstream_at_once(stream_proxy):
    body = {"model": "slow-forever", "stream": True, "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]}
    EVENTS.clear()
    with httpx.Client(timeout=30) as c, c.stream("POST", stream_proxy.url + "/v1/chat/completions", json=body) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data:")
            if n == 5:
                break
    t = time.monotonic()
    while "closed:slow-forever" not in EVENTS and time.monotonic() - t < 3:
        time.sleep(0.02)
    assert "closed:slow-forever" in EVENTS and time.monotonic() - t < 1


def _rss_mb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024


def test_slow_client_backpressure_no_proxy_side_queue(stream_proxy):
    """Upstream, proxy and client share this process: a proxy that queued what the client does not
    read would grow it by the ~90 MB the upstream writes."""
    body = {"model": "flood", "stream": True, "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]}
    before = _rss_mb()
    with httpx.Client(timeout=30) as c, c.stream("POST", stream_proxy.url + "/v1/chat/completions", json=body) as r:
        next(r.iter_raw(65536))
        time.sleep(3)
        assert _rss_mb() - before < 40


def test_a_responses_stream_broken_off_ends_with_its_error_event(stream_proxy):
    """The Responses API's own error event (``type: error``, as a client reading events by type
    expects), holding the ``error`` object the SDKs raise on (a real llama-server killed mid-answer
    ended in the chat completions' error event)."""
    body = {"model": "r-reset", "input": "hi", "stream": True}
    text = httpx.post(stream_proxy.url + "/v1/responses", json=body, timeout=30).text
    name, payload = sse_events(text)[-1]
    event = json.loads(payload)
    assert name == "error" and event["type"] == "error", (name, payload)
    assert event["code"] == "upstream_stream_interrupted" and event["error"]["code"] == event["code"]
