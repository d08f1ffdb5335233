"""Passive health on every kind of failure: one good backend beside one that answers garbage with a
200, one that cuts its streams (before the first event, or after two), one that hangs (its health
check too). Each failure counts against its backend, which is ejected, and a request is sent to the
other backend while nothing of it reached the client: at most 1% of the requests fail.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator

import httpx
import pytest

from bench.hostile_upstream import HostileUpstream
from proxy.app import create_app
from proxy.config import Settings
from tests.helpers import LiveServer

MODEL = "fake-model"
# The failures that cannot be helped come at the start, all at once: streams of the first burst (8 at
# a time) relayed by a backend before anything showed it bad, their content already with the client
# when it breaks them (0-3 in a run, seen). Over 400 requests that fixed start is measured against 1%
# of a run long enough to see its ejections lengthen (1, 2, 4 s ...) and their trials.
REQUESTS = 400


@pytest.fixture
def bad_backend(request: pytest.FixtureRequest) -> Iterator[HostileUpstream]:
    upstream = HostileUpstream(behaviour=request.param, models=(MODEL,)).start()
    yield upstream
    upstream.stop()


def _failed(response: httpx.Response, stream: bool) -> bool:
    """A request the client saw fail: an error status, or a stream with an error event or no end."""
    if response.status_code != 200:
        return True
    if not stream:
        return not response.json().get("choices")
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return True
    return any('"error"' in event and json.loads(event).get("error") for event in events[:-1])


@pytest.mark.parametrize("bad_backend", ["not-json", "cut", "cut-mid", "hang"], indirect=True)
def test_a_bad_backend_beside_a_good_one_fails_at_most_one_request_in_a_hundred(
    fake_backend: LiveServer, bad_backend: HostileUpstream
) -> None:
    settings = Settings(
        upstreams=[fake_backend.url + "/v1", bad_backend.url],
        routing={
            "policy": "round_robin",
            "health_check_interval_s": 0,  # passive health alone
            "first_token_timeout_s": 0.5,
        },
    )
    proxy = LiveServer(create_app(settings)).start()
    try:
        failures, ejections = _run(proxy)
    finally:
        proxy.stop()
    summary = f"{bad_backend.behaviour}: {failures} of {REQUESTS} failed; ejections {ejections}"
    print(summary)
    assert failures <= REQUESTS // 100, summary
    assert ejections, "the bad backend was never ejected"


def _run(proxy: LiveServer) -> tuple[int, list[str]]:
    """REQUESTS requests, half streamed, 8 at a time: how many failed, and the ejections counted."""

    def one(i: int) -> bool:
        stream = i % 2 == 0
        body = {
            "model": MODEL,
            "max_tokens": 8,
            "stream": stream,
            "messages": [{"role": "user", "content": f"Question {i}: what is a masonry bit?"}],
        }
        response = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=60)
        return _failed(response, stream)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        failures = sum(pool.map(one, range(REQUESTS)))
    metrics = httpx.get(proxy.url + "/metrics").text
    ejections = [
        line
        for line in metrics.splitlines()
        if line.startswith("prefix_proxy_backend_ejections_total{") and not line.endswith(" 0.0")
    ]
    return failures, ejections
