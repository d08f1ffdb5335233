"""bench.overhead's instant-backend mode end to end at a small size, and bench.stacks on a known profile."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import xml.dom.minidom
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench import inprocess, stacks
from bench.overhead import CLOCK_TICKS, PRECISE_CPU, CpuReading, cpu_reading, instant_mode, parser

PROFILE = """\
main (app.py:1);serve (app.py:5);handle (app.py:9);parse (app.py:20) 6
main (app.py:1);serve (app.py:5);handle (app.py:9) 2
main (app.py:1);serve (app.py:5);write (libc.so.6) 2
"""


async def test_instant_mode_prints_the_hop_table_for_prefix_proxy() -> None:
    args = parser().parse_args(
        ["--instant", "--requests", "50", "--tokens", "500", "--shapes", "oneline", "--no-peers", "--sessions", "20"]
    )
    report = await instant_mode(args)
    lines = report.splitlines()
    assert lines[0] == "500-token chat, instant backend, 50 requests per measurement"
    assert lines[1] == "| added to direct | prefix-proxy |"
    cpu = next(line for line in lines if line.startswith("| CPU per request in the proxy (ms) |"))
    assert float(cpu.split("|")[2]) > 0
    assert "prefix-proxy: RSS after 20 more sessions:" in report


async def test_instant_mode_runs_the_bare_stack_beside_prefix_proxy() -> None:
    args = parser().parse_args(["--instant", "--requests", "50", "--tokens", "500", "--shapes", "oneline"])
    report = await instant_mode(args)
    header = report.splitlines()[1]
    assert header.startswith("| added to direct | prefix-proxy | bare stack (no logic) |")
    cpu = next(line for line in report.splitlines() if line.startswith("| CPU per request in the proxy (ms) |"))
    cells = [float(cell) for cell in cpu.split("|")[2:-1]]
    if PRECISE_CPU:
        # Counted in nanoseconds: every hop's figure is there, however cheap (shown to 0.01 ms).
        assert all(cell > 0 for cell in cells), cpu
        assert "CPU is read from /proc in nanoseconds" in report
    else:
        # 50 requests through a peer costing 0.2 ms each fit in one /proc clock tick: only
        # prefix-proxy's figure is sure to be above zero at this size, and the report says how coarse it is.
        assert cells[0] > 0 and all(cell >= 0 for cell in cells)
        assert "CPU is read from /proc in 1/" in report


def test_cpu_is_counted_in_nanoseconds_and_agrees_with_the_clock_ticks() -> None:
    """The hop's CPU figure: each thread's time from the kernel in nanoseconds (1/100 s ticks
    over 300 requests were +-0.13 ms a request, half of vLLM Router's own figure). A child burns
    about 0.3 s on two threads: read in nanoseconds, the same as in ticks within a tick per
    thread; and where a thread of the first reading ended before the second (its count went with
    it), the ticks, which keep it."""
    script = (
        "import threading, time, sys\n"
        "def burn():\n"
        "    end = time.thread_time() + 0.15\n"
        "    while time.thread_time() < end: pass\n"
        "burnt, release = threading.Event(), threading.Event()\n"
        "def work(): burn(); burnt.set(); release.wait()\n"
        "worker = threading.Thread(target=work); worker.start()\n"
        "burn(); burnt.wait(); sys.stdout.write('burnt\\n'); sys.stdout.flush()\n"
        "sys.stdin.readline(); release.set(); worker.join(); burn(); sys.stdout.write('done\\n'); sys.stdout.flush()\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdin is not None and child.stdout is not None
        start = CpuReading({}, 0)
        assert child.stdout.readline() == "burnt\n"
        time.sleep(0.05)  # both threads waiting: their counts are up to date
        both = cpu_reading(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        time.sleep(0.05)
        after = cpu_reading(child.pid)
    finally:
        child.kill()
        child.wait()
    assert PRECISE_CPU, "this kernel keeps no schedstat: the hop reads clock ticks"
    assert len(both.threads) == 2 and len(after.threads) == 1
    assert both - start >= 0.3
    assert abs((both - start) - both.ticks / CLOCK_TICKS) <= 2 / CLOCK_TICKS
    # The worker ended between the two readings: read from the ticks, its time not lost.
    assert after - both == (after.ticks - both.ticks) / CLOCK_TICKS
    assert abs((after - both) - 0.15) <= 3 / CLOCK_TICKS


async def test_instant_mode_measures_real_request_shapes_side_by_side() -> None:
    args = parser().parse_args(["--instant", "--requests", "20", "--tokens", "1000", "--shapes", "dify,claude-code"])
    report = await instant_mode(args)
    assert report.startswith("dify: Dify app: ")
    assert "\nclaude-code: Claude Code on /v1/messages: " in report
    summary = report.split("Every shape (CPU per request in the proxy process; added = proxied - direct):\n")[1]
    summary = summary.split("\n\n")[0]  # that table alone: what is saved follows in its own
    rows = [line for line in summary.splitlines() if line.startswith("| dify |") or line.startswith("| claude-code |")]
    assert len(rows) == 2
    assert "prompts: " in report  # says which data the prompts came from


def test_top_entries_by_own_and_total_samples(tmp_path: Path) -> None:
    path = tmp_path / "profile.txt"
    path.write_text(PROFILE)
    profile = stacks.read(path)
    assert sum(profile.values()) == 10
    own, total = stacks.top(profile, 3)
    assert own == [("parse (app.py:20)", 0.6), ("handle (app.py:9)", 0.2), ("write (libc.so.6)", 0.2)]
    # main and serve are on every stack: left out of the totals.
    assert total == [("handle (app.py:9)", 0.8), ("parse (app.py:20)", 0.6), ("write (libc.so.6)", 0.2)]
    assert "| 60.0% | `parse (app.py:20)` | | 80.0% | `handle (app.py:9)` |" in stacks.markdown(profile, 3)


def test_flame_graph_is_valid_svg_with_one_box_per_frame() -> None:
    profile: Counter[tuple[str, ...]] = Counter({("a", "b<c>"): 3, ("a", "d"): 1})
    document = xml.dom.minidom.parseString(stacks.svg(profile, "t&t"))
    titles = [node.firstChild.data for node in document.getElementsByTagName("title")]  # type: ignore[union-attr]
    assert titles == ["a (4 samples, 100.0%)", "b<c> (3 samples, 75.0%)", "d (1 samples, 25.0%)"]


def test_inprocess_driver_times_the_app_and_its_parts(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--requests", "5", "--rounds", "2", "--tokens", "300"]
    for extra in (
        [],
        ["--settings", '{"cache_breaks": {"enabled": false}}'],
        ["--bare"],
        ["--bare", "--json"],
        ["--messages", "4"],
    ):
        inprocess.main([*small, *extra])
        line = capsys.readouterr().out.strip()
        assert line.startswith("CPU per request in process: min "), line
        assert len(line.split("rounds: ")[1].rstrip(")").split(", ")) == 2


def test_inprocess_bodies_only_makes_the_rounds_bodies_and_sends_none(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``bench.instructions`` takes off its counts: the driver making the same bodies, the
    same number of them, with no backend and no app."""
    made: list[int] = []
    maker = inprocess.body_maker

    def counting(args: Any) -> Any:
        bodies, path = maker(args)

        def counted(count: int) -> list[bytes]:
            made.append(count)
            return bodies(count)

        return counted, path

    monkeypatch.setattr(inprocess, "body_maker", counting)
    monkeypatch.setattr(inprocess, "spawn", None)  # starting a backend would fail
    inprocess.main(["--shape", "dify", "--requests", "7", "--rounds", "3", "--tokens", "300", "--bodies-only"])
    assert made == [inprocess.WARM_UP, 7, 7, 7]
    assert capsys.readouterr().out == ""
    bodies, path = maker(inprocess.parser().parse_args(["--shape", "dify", "--tokens", "300"]))
    assert path == "/v1/chat/completions" and json.loads(bodies(1)[0])["messages"][0]["role"] == "system"


def test_inprocess_patch_runs_the_prototype_before_the_app_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--patch``: a prototype patches the proxy's functions, and the app built after it calls
    the patched ones (what ``bench.instructions --patch`` counts)."""
    import proxy.observability.digests as digests

    calls = tmp_path / "calls"
    prototype = tmp_path / "prototype.py"
    prototype.write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "import proxy.observability.digests as digests\n"
        "whole = digests.digest_prompt\n"
        "def digest_prompt(*args, **kwargs):\n"
        f"    with Path({str(calls)!r}).open('a') as out:\n"
        "        out.write('.')\n"
        "    return whole(*args, **kwargs)\n"
        "for module in list(sys.modules.values()):\n"
        "    if getattr(module, 'digest_prompt', None) is whole:\n"
        "        module.digest_prompt = digest_prompt\n"
    )
    for module in list(sys.modules.values()):
        if getattr(module, "digest_prompt", None) is digests.digest_prompt:
            monkeypatch.setattr(module, "digest_prompt", digests.digest_prompt)  # put back afterwards
    inprocess.main(["--requests", "3", "--rounds", "1", "--tokens", "300", "--patch", str(prototype)])
    assert capsys.readouterr().out.startswith("CPU per request in process: min ")
    assert len(calls.read_text()) >= 3


def test_json_without_the_bare_stack_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``--json`` only changes the bare stack: given alone it would count the proxy unchanged."""
    with pytest.raises(SystemExit):
        inprocess.main(["--json"])
    assert "--json parses the body in the bare stack: give it with --bare" in capsys.readouterr().err
