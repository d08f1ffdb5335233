"""bench.llama_workload's pass over a backend (the fake vLLM here; llama-server in bench/) and its floor,
the measure bench.workload reports (bench.floors.ShapeFloors)."""

from __future__ import annotations

from bench.llama_workload import run
from testbed.fakevllm import FakeBackendConfig, create_app
from tests.helpers import LiveServer


def test_a_pass_reports_prefill_and_the_floor_of_what_it_sent() -> None:
    server = LiveServer(create_app(FakeBackendConfig())).start()
    try:
        rows, floors = run(server.url + "/v1", ["stable_app"], 2, 16, model=None)
    finally:
        server.stop()
    row = rows["stable_app"]
    assert row.requests == floors.requests > 2 and row.errors == 0
    assert 0 < floors.tokens["stable_app"] <= row.prefill, "no arrangement computes less than the floor"
