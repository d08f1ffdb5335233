"""Budgets that count every token: a reservation covers every completion requested (``n``) and the
most the prompt can be, so with ``max_tokens`` set no number of concurrent requests, on any number
of replicas sharing Redis, spends past a limit. Overshoot is measured against what the backend
reported it spent (the answers' own ``usage``), not against the proxy's bookkeeping.
"""

from __future__ import annotations

import concurrent.futures
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from proxy.chat.budget import completion_allowance, completions_requested, prompt_ceiling
from proxy.config import BudgetSettings
from proxy.http import reading
from tests.helpers import LiveServer, ProxyProcess, steady_window_s
from tests.test_redis_e2e import redis_env

MODEL = "fake-model"
SYSTEM = {
    "role": "system",
    "content": "You are the support assistant of a hardware store.\nAnswer in two sentences.\n" * 12,
}


def chat(url: str, body: dict[str, Any], session: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=60)


def test_a_reservation_counts_every_completion() -> None:
    budget = BudgetSettings()
    assert completions_requested({"n": 8}) == 8
    assert completions_requested({"n": 2, "best_of": 5}) == 5
    # Counts as the engine reads them (proxy.http.reading): true is 1, "9" is 9.
    assert completions_requested(reading.CHAT.read({"n": True, "best_of": "9"})) == 9
    assert completion_allowance({"n": 8, "max_tokens": 100}, budget) == 800
    assert completion_allowance({"n": 3}, budget) == 3 * budget.completion_reserve_tokens
    # The prompt ceiling bounds any tokenizer: at least one byte per token of text.
    assert prompt_ceiling(1000, 3) >= 1000


def test_n_completions_are_charged_n_times(make_proxy: Callable[..., LiveServer]) -> None:
    server = make_proxy(budget={"session_tokens_per_window": 4_000, "window_s": steady_window_s()})
    session = f"n-{uuid.uuid4()}"
    body = {"model": MODEL, "max_tokens": 600, "messages": [SYSTEM, {"role": "user", "content": "hi"}]}
    # 8 completions of up to 600 tokens: more than 4,000, refused before any is made.
    refused = chat(server.url, {**body, "n": 8}, session)
    assert refused.status_code == 429, refused.text
    answered = chat(server.url, {**body, "n": 2}, session)
    assert answered.status_code == 200, answered.text
    assert len(answered.json()["choices"]) == 2
    usage = answered.json()["usage"]
    state = httpx.get(
        f"{server.url}/v1/sessions/{answered.headers['x-prefix-proxy-session']}", headers={"x-session-id": session}
    ).json()
    # What the backend spent on both completions is what the budget was charged.
    assert state["budget_left"]["session"] == 4_000 - usage["prompt_tokens"] - usage["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_two_replicas_200_concurrent_requests_never_overshoot(
    start_proxies: Callable[..., list[ProxyProcess]], redis_prefix: str, stream: bool
) -> None:
    limit = 30_000
    env = redis_env(
        redis_prefix,
        PREFIX_PROXY_BUDGET__SESSION_TOKENS_PER_WINDOW=str(limit),
        PREFIX_PROXY_BUDGET__WINDOW_S=str(steady_window_s()),
    )
    replicas = start_proxies(2, env)
    session = f"concurrent-{uuid.uuid4()}"
    # The session's first turn is plain English (about 4 bytes a token): what the proxy learns of the
    # session's tokens per byte from it is far too low for what follows, text of ids and numbers
    # (about 1.5 bytes a token), as a hostile tenant would send to stretch its budget.
    first = {"model": MODEL, "max_tokens": 16, "messages": [SYSTEM, {"role": "user", "content": "Hello there."}]}
    opening = chat(replicas[0].url, first, session)
    assert opening.status_code == 200
    first_spent = opening.json()["usage"]["total_tokens"]
    dense = " ".join(uuid.UUID(int=i * 7919 + 13).hex for i in range(40))

    def one(i: int) -> tuple[int, int]:
        body: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 48,
            "messages": [SYSTEM, {"role": "user", "content": f"Question {i}: which of these ids? {dense}"}],
            "fake_options": {"reply": "Use a hammer drill with a masonry bit, and go slowly. " * 8},
        }
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        response = chat(replicas[i % 2].url, body, session)
        if response.status_code != 200:
            return response.status_code, 0
        if not stream:
            usage = response.json()["usage"]
            return 200, usage["prompt_tokens"] + usage["completion_tokens"]
        spent = 0
        for line in response.text.splitlines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = httpx.Response(200, content=line[6:]).json().get("usage")
                if usage:
                    spent = usage["prompt_tokens"] + usage["completion_tokens"]
        return 200, spent

    with concurrent.futures.ThreadPoolExecutor(200) as pool:
        results = list(pool.map(one, range(200)))
    statuses = [status for status, _ in results]
    spent = first_spent + sum(tokens for _, tokens in results)
    store_errors = sum(
        float(line.rsplit(" ", 1)[1])
        for replica in replicas
        for line in httpx.get(replica.url + "/metrics").text.splitlines()
        if line.startswith("prefix_proxy_store_errors_total ")
    )
    summary = (
        f"200 concurrent over 2 replicas: {statuses.count(200)} answered, {statuses.count(429)} refused, "
        f"{spent} of {limit} tokens spent ({spent - limit:+d} over), {store_errors:.0f} store errors, "
        f"statuses {sorted(set(statuses))}"
    )
    print(summary)
    # The guarantee holds while the store answers (during an outage requests are admitted unreserved).
    assert store_errors == 0, summary
    assert set(statuses) <= {200, 429}, summary
    assert statuses.count(429) > 0, "the limit must be reached for the test to mean anything"
    assert spent <= limit, summary
    # Near the limit admission is exact, not merely safe: most of the budget is usable.
    assert spent > limit * 0.6, summary


@pytest.mark.parametrize("stream", [False, True])
def test_completions_spend_the_tenants_budget_too(make_proxy: Callable[..., LiveServer], stream: bool) -> None:
    """No route generates past the tenant's budget: /v1/completions reserves and settles like chat."""
    tenants = [
        {
            "name": "acme",
            "api_key": "sk-acme",
            "budget": {"tenant_tokens_per_window": 3_000, "window_s": steady_window_s()},
        }
    ]
    server = make_proxy(tenants=tenants)
    headers = {"authorization": "Bearer sk-acme"}
    body: dict[str, Any] = {"model": MODEL, "prompt": "Name three hand tools.", "max_tokens": 100, "stream": stream}
    statuses, spent = [], 0
    for _ in range(60):
        response = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)
        statuses.append(response.status_code)
        if response.status_code != 200:
            break
        if not stream:
            spent += response.json()["usage"]["total_tokens"]
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    if not stream:
        assert spent <= 3_000
    # n completions of each of several prompts are reserved as such.
    many = {**body, "stream": False, "prompt": ["a", "b", "c"], "n": 8, "max_tokens": 200}
    fresh = make_proxy(tenants=tenants)
    assert httpx.post(fresh.url + "/v1/completions", json=many, headers=headers, timeout=30).status_code == 429
