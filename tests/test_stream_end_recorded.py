"""A streamed answer is recorded before the client has its last event: a client may name that
answer (cache diagnostics) or send the conversation's next turn the moment it reads ``[DONE]``,
while the upstream's body has not yet ended (an engine that closes its chunked body late, a
network that delays the final chunk). Found by a flaky diagnostics test on a busy machine."""

from __future__ import annotations

import httpx

from bench.hostile_upstream import HostileUpstream
from proxy.app import create_app
from proxy.config import Settings
from tests.helpers import LiveServer

MODEL = "linger"


def test_an_answer_named_the_moment_its_stream_says_done_is_found() -> None:
    upstream = HostileUpstream(behaviour="linger", models=(MODEL,)).start()
    proxy = LiveServer(create_app(Settings(upstreams=[upstream.url]))).start()
    try:
        messages = [{"role": "user", "content": "Which rooms are free on May 3?"}]
        body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": messages}
        client = httpx.Client(base_url=proxy.url, timeout=30)
        with client, client.stream("POST", "/v1/chat/completions", json=body) as stream:
            for line in stream.iter_lines():
                if line == "data: [DONE]":
                    break
            else:
                raise AssertionError("the stream never said [DONE]")
            # The upstream's body is still open for a second: the next request goes now.
            again = {
                "model": MODEL,
                "max_tokens": 8,
                "messages": [
                    *messages,
                    {"role": "assistant", "content": "fine"},
                    {"role": "user", "content": "And May 4?"},
                ],
                "prompt_cache_options": {"comparison_response_id": "c"},
            }
            answer = client.post("/v1/chat/completions", json=again)
        assert answer.status_code == 200, answer.text
        found = answer.json()["prompt_cache_diagnostics"]
        assert found["type"] in ("cache_hit", "cache_miss"), found
    finally:
        proxy.stop()
        upstream.stop()
