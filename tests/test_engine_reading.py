"""One reading: the numbers and flags the proxy budgets on are the ones the engine reads.

The backend is the vLLM-faithful fake, which parses bodies with pydantic as vLLM does (``"8"``,
``8.0`` and ``true`` are integers to it) and, without ``max_tokens``, generates to the end of its
context. Spending is measured from the answers' own ``usage``, never from the proxy's bookkeeping.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from proxy.chat.budget import (
    completion_allowance,
    completions_requested,
    requested_completion_tokens,
    reservation_amount,
    tokens_per_event,
)
from proxy.config import BudgetSettings
from proxy.http import InvalidRequest, reading
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer, steady_window_s

MODEL = "fake-model"
LIMIT = 5_000
CONTEXT = 1_024
LONG_REPLY = "The drill needs a masonry bit, a steady hand and patience with the wall. " * 120
KEY = "sk-acme"


# -- the reading itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "read"), [("8", 8), (8.0, 8), (True, 1), (" 8 ", 8), ("1_000", 1000), (8, 8), (None, None)]
)
def test_numbers_are_read_as_vllm_reads_them(value: Any, read: Any) -> None:
    body = {"model": "m", "n": value, "max_tokens": value}
    reading.CHAT.read(body)
    assert body["n"] == read and body["max_tokens"] == read
    assert type(body["n"]) is type(read)  # what goes upstream is the integer


@pytest.mark.parametrize("value", [8.5, "eight", "1e3", [8], {"n": 8}])
def test_what_vllm_refuses_is_a_400_naming_the_parameter(value: Any) -> None:
    with pytest.raises(InvalidRequest) as refused:
        reading.CHAT.read({"model": "m", "n": value})
    assert refused.value.param == "n"


@pytest.mark.parametrize(("value", "read"), [("false", False), ("true", True), (0, False), ("1", True)])
def test_the_stream_flag_is_read_as_vllm_reads_it(value: Any, read: bool) -> None:
    assert reading.RESPONSES.read({"stream": value})["stream"] is read
    assert reading.MESSAGES.read({"stream": value})["stream"] is read


def test_a_reservation_without_max_tokens_covers_the_context() -> None:
    budget = BudgetSettings()
    body = reading.CHAT.read({"n": "3"})
    assert completions_requested(body) == 3
    # Without max_tokens the engine may generate to the end of the context, for each completion.
    assert completion_allowance(body, budget, 4096) == 3 * 4096
    # A completion's prompt and answer fit in the context: n contexts at most.
    assert reservation_amount(1000, body, budget, 4096) == 3 * 4096
    assert reservation_amount(100, {"max_tokens": 10}, budget, 4096) == 110
    # The context unknown: the configured reserve.
    assert completion_allowance({}, budget) == budget.completion_reserve_tokens


def test_a_reservation_holds_llama_cpps_own_limit() -> None:
    """llama-server reads ``n_predict`` before ``max_tokens`` (tools/server: ``json_value(data,
    "n_predict", json_value(data, "max_tokens", ...))``): a body asking 5 of one and a million of the
    other generates a million there, and the reservation holds what the engine may generate."""
    budget = BudgetSettings()
    assert reservation_amount(100, {"max_tokens": 5, "n_predict": 1_000_000}, budget, 4096) == 4096
    assert completion_allowance({"max_tokens": 5, "n_predict": 1_000}, budget, 4096) == 1_000
    assert completion_allowance({"max_tokens": 500, "n_predict": 10}, budget, 4096) == 500
    # -1: until the context is full; a fraction is cut as nlohmann's get<int> cuts it.
    assert completion_allowance({"max_tokens": 5, "n_predict": -1}, budget, 4096) == 4096
    assert completion_allowance({"max_tokens": 5, "n_predict": 700.9}, budget, 4096) == 700
    assert completion_allowance({"max_tokens": 5, "n_predict": -1}, budget) == budget.completion_reserve_tokens
    # What llama-server does not read as a number leaves max_tokens in force.
    assert completion_allowance({"max_tokens": 5, "n_predict": "900"}, budget, 4096) == 5
    assert completion_allowance({"max_tokens": 5, "n_predict": True}, budget, 4096) == 5


def test_limits_are_read_as_the_engines_read_them() -> None:
    """A review's findings: a 0 in ``max_completion_tokens`` (which vLLM refuses, or where an engine
    reads ``max_completion_tokens or max_tokens``, passes over) leaves ``max_tokens`` reserved, an
    explicit ``"max_tokens": null`` on completions generates to the context's end (its default of 16
    is for an absent field), llama-server's ``n_cmpl`` is its ``n``, and an event of a stream that asks
    ``stream_interval: N`` carries N tokens (what a stream cut short is charged per event)."""
    budget = BudgetSettings()
    assert requested_completion_tokens({"max_completion_tokens": 0, "max_tokens": 100_000}) == 100_000
    assert requested_completion_tokens({"max_completion_tokens": 7, "max_tokens": 100_000}) == 7
    assert completion_allowance({"max_tokens": None}, budget, 4096, engine_default=16) == 4096
    assert completion_allowance({}, budget, 4096, engine_default=16) == 16
    assert completions_requested({"n_cmpl": 8}) == 8
    assert tokens_per_event({"stream_interval": 1000}) == 1000
    assert (
        tokens_per_event({})
        == tokens_per_event({"stream_interval": True})
        == tokens_per_event({"stream_interval": "9"})
        == 1
    )


# -- end to end: 0 tokens over the budget, single and at 20 concurrent ----------------------------


@pytest.fixture(scope="module")
def small_backend() -> Iterator[LiveServer]:
    """A fake vLLM with a 1,024-token context: a request without max_tokens generates to its end."""
    server = LiveServer(create_fake_app(FakeBackendConfig(max_model_len=CONTEXT))).start()
    yield server
    server.stop()


def _proxy(make_proxy: Callable[..., LiveServer], backend: LiveServer) -> LiveServer:
    tenants = [
        {"name": "acme", "api_key": KEY, "budget": {"tenant_tokens_per_window": LIMIT, "window_s": steady_window_s()}}
    ]
    return make_proxy(upstream=backend.url + "/v1", tenants=tenants)


def _question(i: int) -> str:
    return f"Question {i}: how do I drill into a brick wall without cracking it?"


def _chat(i: int, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    messages = [{"role": "user", "content": _question(i)}]
    return "/v1/chat/completions", {"model": MODEL, "messages": messages, **fields}


def _completions(i: int, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"model": MODEL, "prompt": _question(i), **fields}


def _responses(i: int, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    fields = {("max_output_tokens" if k == "max_tokens" else k): v for k, v in fields.items() if k != "n"}
    return "/v1/responses", {"model": MODEL, "input": _question(i), "store": False, **fields}


def _messages(i: int, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    fields = {k: v for k, v in fields.items() if k != "n"}
    fields.setdefault("max_tokens", "900")  # required by the protocol: a string instead of absent
    return "/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": _question(i)}], **fields}


PROTOCOLS = {"chat": _chat, "completions": _completions, "responses": _responses, "messages": _messages}
VARIANTS = {
    "n as a string": {"n": "8", "max_tokens": 300},
    "n as a float": {"n": 8.0, "max_tokens": 300},
    "max_tokens as a string": {"max_tokens": "900"},
    "max_tokens as a float": {"max_tokens": 900.0},
    "no max_tokens": {},
}


def _spent(answer: dict[str, Any]) -> int:
    usage = answer.get("usage") or {}
    if "total_tokens" in usage:
        return int(usage["total_tokens"])
    return int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))


def _send(server: LiveServer, request: tuple[str, dict[str, Any]]) -> tuple[int, int]:
    path, body = request
    body = {**body, "fake_options": {"reply": LONG_REPLY}}
    response = httpx.post(
        server.url + path, json=body, headers={"authorization": f"Bearer {KEY}", "x-api-key": KEY}, timeout=120
    )
    return response.status_code, _spent(response.json()) if response.status_code == 200 else 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_no_request_spends_past_the_budget(
    make_proxy: Callable[..., LiveServer], small_backend: LiveServer, protocol: str, variant: str
) -> None:
    _spends_within_the_budget(make_proxy, small_backend, protocol, VARIANTS[variant], variant)


# OpenAI's limits only (Responses and Messages have fields of their own): an explicit null, which vLLM
# reads as "to the context's end" (its completions' 16 is for an absent field).
LIMIT_VARIANTS = {
    "max_tokens null": {"max_tokens": None},
}


@pytest.mark.parametrize("protocol", ["chat", "completions"])
@pytest.mark.parametrize("variant", LIMIT_VARIANTS)
def test_no_limit_the_engine_reads_otherwise_spends_past_the_budget(
    make_proxy: Callable[..., LiveServer], small_backend: LiveServer, protocol: str, variant: str
) -> None:
    _spends_within_the_budget(make_proxy, small_backend, protocol, LIMIT_VARIANTS[variant], variant)


def _spends_within_the_budget(
    make_proxy: Callable[..., LiveServer],
    small_backend: LiveServer,
    protocol: str,
    fields: dict[str, Any],
    variant: str,
) -> None:
    make = PROTOCOLS[protocol]
    # One at a time until the budget refuses.
    server = _proxy(make_proxy, small_backend)
    spent, statuses = 0, []
    for i in range(12):
        status, tokens = _send(server, make(i, dict(fields)))
        statuses.append(status)
        spent += tokens
        if status == 429:
            break
    assert set(statuses) <= {200, 429}, statuses
    assert spent <= LIMIT, f"{protocol}, {variant}: {spent} of {LIMIT} spent one at a time ({statuses})"
    # Twenty at once, on a fresh budget.
    server = _proxy(make_proxy, small_backend)
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda i: _send(server, make(i, dict(fields))), range(20)))
    statuses = [status for status, _ in results]
    spent = sum(tokens for _, tokens in results)
    assert set(statuses) <= {200, 429}, statuses
    assert spent <= LIMIT, f"{protocol}, {variant}: {spent} of {LIMIT} spent by 20 at once ({statuses})"
    assert 200 in statuses or variant.startswith("n as")  # the budget admits what fits


# -- content parts: a kind that is not a string is vLLM's 400, not the proxy's 500 ------------------


@pytest.mark.parametrize("kind", [{}, {"a": 1}, [1], 5])
def test_a_content_part_whose_type_is_not_a_string_is_a_400(kind: Any) -> None:
    from proxy.http import validate_chat_request
    from proxy.protocols.responses import validate_request

    with pytest.raises(InvalidRequest) as chat:
        validate_chat_request({"model": "m", "messages": [{"role": "user", "content": [{"type": kind, "text": "x"}]}]})
    assert chat.value.param == "messages[0].content[0].type"
    with pytest.raises(InvalidRequest) as responses:
        validate_request({"model": "m", "input": [{"role": "user", "content": [{"type": kind, "text": "x"}]}]})
    assert responses.value.param == "input[0].content[0].type"


def test_a_stream_its_client_leaves_is_charged_what_its_events_could_carry(
    make_proxy: Callable[..., LiveServer], small_backend: LiveServer
) -> None:
    """vLLM sends an event every ``stream_interval`` tokens: a stream the client leaves after its
    first event brings no usage, and was charged the prompt and one token, whatever the interval
    (a review: 8 streams of ``stream_interval: 1000`` passed a 2,000-token budget). Charged 1,000
    tokens for that event, the next request of 1,000 no longer fits."""
    tenants = [
        {"name": "acme", "api_key": KEY, "budget": {"tenant_tokens_per_window": 2000, "window_s": steady_window_s()}}
    ]
    server = make_proxy(upstream=small_backend.url + "/v1", tenants=tenants)
    headers = {"authorization": f"Bearer {KEY}"}
    path, body = _chat(0, {"max_tokens": 1000, "stream": True, "stream_interval": 1000})
    # A token every 50 ms: the engine is still generating when the client leaves (the proxy then
    # closes the upstream, as vLLM aborts, and no usage comes).
    body = {**body, "fake_options": {"reply": LONG_REPLY, "chunk_delay_s": 0.05}}
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # the client leaves after the first event
    time.sleep(1.0)  # the proxy settles once it sees the client gone
    status, _ = _send(server, _chat(1, {"max_tokens": 1000}))
    assert status == 429
