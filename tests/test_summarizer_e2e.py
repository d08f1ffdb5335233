"""The summarizer through the real proxy and the fake backend (which answers summary requests)."""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.config import Settings
from summarizer.anchor import SUMMARY_HEADER
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer
from tests.redis_server import SHARED_URL, delete_prefix, require_shared_redis, unique_prefix

MODEL = "fake-model"
SYSTEM = {"role": "system", "content": "You are a patient tutor of European history. Answer briefly."}
GENERATION_PROMPT = "<|im_start|>assistant\n"


@pytest.fixture
def backend() -> Iterator[LiveServer]:
    server = LiveServer(create_fake_app(FakeBackendConfig())).start()
    yield server
    server.stop()


def proxy_for(backend: LiveServer, **settings: Any) -> LiveServer:
    return LiveServer(create_app(Settings(upstream=backend.url + "/v1", **settings))).start()


def question(turn: int) -> str:
    return f"Turn {turn}: explain one cause of the Thirty Years' War and one consequence for the Holy Roman Empire."


def backend_log(backend: LiveServer) -> list[dict[str, Any]]:
    return sorted(
        httpx.get(backend.url + "/fake/requests", params={"limit": 256}).json(), key=lambda r: r["received_at"]
    )


def metric(server: LiveServer, name: str, labels: str = "") -> float:
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def play(server: LiveServer, turns: int, max_tokens: int = 60) -> list[httpx.Response]:
    history: list[dict[str, Any]] = [SYSTEM]
    responses = []
    for turn in range(turns):
        history.append({"role": "user", "content": question(turn)})
        response = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": history, "max_tokens": max_tokens},
            timeout=60,
        )
        responses.append(response)
        if response.status_code != 200:
            break
        history.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
        time.sleep(0.05)  # the client reads; background compaction runs meanwhile
    return responses


def computed_prefill(responses: list[httpx.Response]) -> int:
    usages = [r.json()["usage"] for r in responses]
    return sum(u["prompt_tokens"] - ((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for u in usages)


def test_a_ready_summary_waits_until_the_conversation_needs_it() -> None:
    """Swapping a summary in costs one recompute of the turns after it. By default it happens only
    once the whole history would not fit (where a direct connection is refused): until then the
    conversation costs what a direct one does, and it is never refused. Applied as soon as ready
    (apply_ratio 0) it swaps in earlier and pays for it while the history would still have fit."""
    limit, turns = 1500, 30
    runs = {}
    for ratio in (1.0, 0.0):
        backend = LiveServer(create_fake_app(FakeBackendConfig())).start()  # a cold cache for each run
        server = proxy_for(
            backend,
            budget={"context_limit_tokens": limit, "soft_ratio": 0.6},
            summarizer={"max_summary_tokens": 120, "apply_ratio": ratio},
        )
        try:
            responses = play(server, turns)
        finally:
            server.stop()
            backend.stop()
        assert [r.status_code for r in responses] == [200] * turns
        assert all(r.json()["usage"]["prompt_tokens"] <= limit for r in responses)
        summarized = ["summary_anchored" in r.headers.get("x-prefix-proxy-actions", "") for r in responses]
        runs[ratio] = (summarized, responses)
    (deferred, deferred_responses), (eager, eager_responses) = runs[1.0], runs[0.0]
    first_deferred, first_eager = deferred.index(True), eager.index(True)
    assert first_eager < first_deferred, "by default the summary waits while the history still fits"
    assert not any(deferred[:first_deferred])
    # Until then the deferred conversation pays what a direct one would; the eager one paid for swaps.
    before = slice(0, first_deferred)
    assert computed_prefill(deferred_responses[before]) < computed_prefill(eager_responses[before])


def test_long_conversation_stays_under_the_hard_limit_with_stable_prefixes(backend: LiveServer) -> None:
    limit = 1500
    server = proxy_for(backend, budget={"context_limit_tokens": limit}, summarizer={"max_summary_tokens": 120})
    try:
        responses = play(server, 40)
        assert [r.status_code for r in responses] == [200] * 40
        assert all(r.json()["usage"]["prompt_tokens"] <= limit for r in responses)
        assert metric(server, "prefix_proxy_compactions_total", 'outcome="succeeded"') >= 2
        assert metric(server, "prefix_proxy_compactions_total", 'outcome="failed"') == 0
    finally:
        server.stop()

    chats = [r for r in backend_log(backend) if "Write a summary of the conversation" not in r["prompt_text"]]
    versions = [_summary_version(r["prompt_text"]) for r in chats]
    assert len(set(versions)) >= 3, "the summary changed at compaction points"
    stable_pairs = 0
    for previous, current in itertools.pairwise(chats):
        if _summary_version(previous["prompt_text"]) == _summary_version(current["prompt_text"]):
            # Between compactions the forwarded prompt only grows: the old one is its exact prefix.
            assert current["prompt_text"].startswith(previous["prompt_text"][: -len(GENERATION_PROMPT)])
            stable_pairs += 1
    assert stable_pairs >= 30


def _summary_version(prompt: str) -> str | None:
    start = prompt.find(SUMMARY_HEADER)
    return None if start < 0 else prompt[start : prompt.find("<|im_end|>", start)]


def test_failing_summarizer_leaves_the_conversation_intact(backend: LiveServer) -> None:
    budget = {"context_limit_tokens": 1400, "soft_ratio": 0.5}
    # Compacting at the soft threshold whatever the growth (lookahead 0): the summary fails early on.
    summarizer = {"model": "no-such-model", "retry_backoff_s": 0, "lookahead_requests": 0}
    server = proxy_for(backend, budget=budget, summarizer=summarizer)
    try:
        responses = play(server, 12)
        assert [r.status_code for r in responses] == [200] * 12
        assert metric(server, "prefix_proxy_compactions_total", 'outcome="failed"') >= 1
        assert metric(server, "prefix_proxy_compactions_total", 'outcome="succeeded"') == 0
    finally:
        server.stop()
    last = [r for r in backend_log(backend) if r["body"].get("model") == MODEL][-1]
    assert SUMMARY_HEADER not in last["prompt_text"]
    assert all(question(turn) in last["prompt_text"] for turn in range(12)), "no message was dropped"


def test_two_replicas_compact_a_session_exactly_once() -> None:
    require_shared_redis()
    prefix = unique_prefix()
    slow = LiveServer(create_fake_app(FakeBackendConfig(seconds_per_output_token=0.02))).start()
    settings = {
        "budget": {"context_limit_tokens": 900, "soft_ratio": 0.3},
        "summarizer": {"max_summary_tokens": 80},
        "sessions": {"store": "redis", "redis_url": SHARED_URL, "key_prefix": prefix},
        "admin_api_key": "admin",
    }
    replicas = [proxy_for(slow, **settings) for _ in range(2)]
    try:
        history: list[dict[str, Any]] = [SYSTEM]
        for turn in range(5):
            history.append({"role": "user", "content": question(turn)})
            history.append({"role": "assistant", "content": f"Answer {turn}: " + "the Peace of Westphalia. " * 8})
        history.append({"role": "user", "content": question(5)})
        body = {"model": MODEL, "messages": history, "max_tokens": 5}
        headers = {"x-session-id": "shared-session"}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(
                pool.map(
                    lambda r: httpx.post(r.url + "/v1/chat/completions", json=body, headers=headers, timeout=60),
                    replicas,
                )
            )
        assert [r.status_code for r in results] == [200, 200]
        session_id = results[0].headers["x-prefix-proxy-session"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            record = httpx.get(
                f"{replicas[0].url}/admin/tenants/anonymous/sessions/{session_id}",
                headers={"authorization": "Bearer admin"},
            ).json()
            if record.get("summary"):
                break
            time.sleep(0.2)
        time.sleep(3)  # let any second compaction finish, if one (wrongly) started
        record = httpx.get(
            f"{replicas[0].url}/admin/tenants/anonymous/sessions/{session_id}",
            headers={"authorization": "Bearer admin"},
        ).json()
        assert record["summary"]["version"] == 1
        assert sum(metric(r, "prefix_proxy_compactions_total", 'outcome="succeeded"') for r in replicas) == 1
        summaries = [r for r in backend_log(slow) if "Write a summary of the conversation" in r["prompt_text"]]
        assert len(summaries) == 1
    finally:
        for replica in replicas:
            replica.stop()
        slow.stop()
        delete_prefix(SHARED_URL, prefix)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_battle",
            "description": "Look up a battle of the Thirty Years' War by name.",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        },
    }
]


def test_compaction_never_splits_tool_calls_from_their_results(backend: LiveServer) -> None:
    server = proxy_for(
        backend,
        budget={"context_limit_tokens": 2500, "soft_ratio": 0.5},
        # Applied as soon as ready: this test is about where the cut falls, on many compactions.
        summarizer={"max_summary_tokens": 100, "keep_last_turns": 2, "apply_ratio": 0},
    )
    history: list[dict[str, Any]] = [SYSTEM]
    try:
        for turn in range(14):
            history.append({"role": "user", "content": question(turn)})
            for _ in range(3):  # agent loop: tool calls until a text answer
                body = {"model": MODEL, "messages": history, "tools": TOOLS, "max_tokens": 60}
                response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
                assert response.status_code == 200, response.text
                message = response.json()["choices"][0]["message"]
                history.append({k: message[k] for k in ("role", "content", "tool_calls") if message.get(k)})
                if not message.get("tool_calls"):
                    break
                for call in message["tool_calls"]:
                    history.append({"role": "tool", "tool_call_id": call["id"], "content": "Battle of Lützen, 1632."})
            time.sleep(0.05)
        assert metric(server, "prefix_proxy_compactions_total", 'outcome="succeeded"') >= 1
    finally:
        server.stop()
    forwarded = [r for r in backend_log(backend) if "Write a summary" not in r["prompt_text"]]
    summarized = [r for r in forwarded if SUMMARY_HEADER in r["prompt_text"]]
    assert summarized, "later requests carry the summary"
    for request in summarized:
        messages = request["body"]["messages"]
        after_summary = messages[
            next(i for i, m in enumerate(messages) if SUMMARY_HEADER in str(m.get("content"))) + 1 :
        ]
        assert after_summary[0]["role"] == "user", "the kept history starts at a user turn"
        call_ids = {c["id"] for m in after_summary for c in m.get("tool_calls") or []}
        result_ids = {m["tool_call_id"] for m in after_summary if m["role"] == "tool"}
        assert result_ids <= call_ids, "every tool result kept has its call"


def test_a_summary_is_computed_ahead_only_when_the_conversation_will_need_it(backend: LiveServer) -> None:
    """Past the soft threshold, a conversation that grows slowly (a long system prompt, short turns)
    would not need its summary within ``lookahead_requests`` requests: none is computed, and the
    backend gets only the client's requests. The same conversation with a lookahead long enough to
    reach its limit gets its summary computed ahead."""
    long_system = {"role": "system", "content": SYSTEM["content"] + " Cite the treaty names exactly." * 60}
    limit = 1000

    def run(lookahead: int) -> tuple[float, int]:
        server = proxy_for(
            backend,
            budget={"context_limit_tokens": limit, "soft_ratio": 0.5},
            summarizer={"lookahead_requests": lookahead, "keep_last_turns": 1},
        )
        httpx.post(backend.url + "/fake/reset")
        try:
            history: list[dict[str, Any]] = [long_system]
            for turn in range(6):
                history.append({"role": "user", "content": f"Turn {turn}: one cause, briefly."})
                response = httpx.post(
                    server.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": history, "max_tokens": 8},
                    headers={"x-session-id": f"slow-{lookahead}"},
                    timeout=60,
                )
                assert response.status_code == 200, response.text
                history.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
                time.sleep(0.05)
            time.sleep(0.3)  # a compaction started after the last answer
            started = metric(server, "prefix_proxy_compactions_total", 'outcome="started"')
            prompt = history and response.json()["usage"]["prompt_tokens"]
        finally:
            server.stop()
        return started, prompt

    started, prompt = run(lookahead=4)
    assert limit * 0.5 < prompt < limit * 0.9  # past the soft threshold, and far from the limit
    assert started == 0
    started, _ = run(lookahead=1000)
    assert started >= 1
