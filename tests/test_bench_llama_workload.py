"""bench.llama_workload's pass over a backend (the fake vLLM here; llama-server in bench/) and its floor,
the measure bench.workload reports (bench.floors.ShapeFloors)."""

from __future__ import annotations

from pathlib import Path

from bench.llama_workload import SlotPicks, run
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


def test_slot_picks_are_read_from_llama_servers_own_log(tmp_path: Path) -> None:
    """The lines llama-server logs as a request gets a slot (seen on the real server, llama.cpp of
    llama-cpp-python 0.3.36): by id, by similarity, by LRU (t_last -1: a slot never used)."""
    log = tmp_path / "llama.log"
    log.write_text(
        "0.03.997.222 I slot get_availabl: id  1 | task -1 | selected slot by LRU, t_last = -1\n"
        "0.04.216.541 I slot get_availabl: id  1 | task -1 | selected slot by LCP similarity, f_sim_best = 0.686 "
        "(> 0.100 thold), f_keep = 0.533\n"
        "0.05.100.000 I slot get_availabl: id  0 | task -1 | selected slot by LRU, t_last = 4216541\n"
        "0.06.100.000 I slot get_availabl: id  0 | task -1 | selected slot by id (0)\n"
        "0.07.100.000 I srv  update_slots: all slots are idle\n"
    )
    picks = SlotPicks.read(log)
    assert (picks.named, picks.similar, picks.fresh, picks.evicting) == (1, 1, 1, 1)
    assert SlotPicks.read(tmp_path / "absent.log") == SlotPicks()
