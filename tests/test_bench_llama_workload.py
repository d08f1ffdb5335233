"""bench.llama_workload's floor (pure) and its pass over a backend (the fake vLLM here; llama-server in bench/)."""

from __future__ import annotations

from bench.llama_workload import Sent, floor_tokens, run
from testbed.fakevllm import FakeBackendConfig, create_app
from tests.helpers import LiveServer


def test_the_floor_counts_only_lines_no_earlier_request_of_the_app_carried() -> None:
    system = {"role": "system", "content": "Current time: 10:00\nYou are helpful.\nBe brief."}
    later = {"role": "system", "content": "Current time: 10:05\nYou are helpful.\nBe brief."}
    first = Sent("app", [system, {"role": "user", "content": "hi"}], [], 100)
    second = Sent(
        "app",
        [
            later,
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"},
        ],
        [],
        100,
    )
    other_app = Sent("other", [system], [], 50)
    floors = floor_tokens([first, second, other_app])
    assert floors[0] == 100, "a first request is all new"
    # Only "Current time: 10:05" and "bye" are new; the reply counts as seen.
    new = len("Current time: 10:05\n") + len("bye\n")
    total = sum(
        len(line) + 1 for line in ["Current time: 10:05", "You are helpful.", "Be brief.", "hi", "hello", "bye"]
    )
    assert floors[1] == round(new * 100 / total)
    assert floors[2] == 50, "apps are apart"


def test_a_pass_reports_prefill_and_the_requests_it_sent() -> None:
    server = LiveServer(create_app(FakeBackendConfig())).start()
    try:
        rows, sent = run(server.url + "/v1", ["stable_app"], 2, 16, model=None)
    finally:
        server.stop()
    row = rows["stable_app"]
    assert row.requests == len(sent) > 2 and row.errors == 0
    floors = floor_tokens(sent)
    assert 0 < sum(floors) <= row.prefill, "no arrangement computes less than the floor"
