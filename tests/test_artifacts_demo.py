"""``prefix-proxy demo`` ends on what its table means, why the pass through the proxy took longer (each
part's CPU time, the proxy's own per request), and the command to put the proxy in front of a real backend."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from testbed.demo import NEXT_STEPS, DemoResult, main, thread_cpu_s
from testbed.workload.runner import ScenarioResult


def scenario(name: str, requests: int, prompt: int, cached: int) -> ScenarioResult:
    return ScenarioResult(name, sessions=1, requests=requests, prompt_tokens=prompt, cached_tokens=cached)


def measured() -> DemoResult:
    """The figures of a full demo run on a 2-core machine (seconds of CPU per part, per pass)."""
    return DemoResult(
        direct={"a": scenario("a", 2000, 5_000_000, 3_000_000), "b": scenario("b", 792, 1_000_000, 900_000)},
        proxied={"a": scenario("a", 2000, 5_000_000, 4_600_000), "b": scenario("b", 792, 1_000_000, 900_000)},
        sessions=32,
        seed=0,
        block_size=16,
        scenarios=["a", "b"],
        phase_s={"direct": 22.2, "proxied": 46.4},
        phase_cpu_s={
            "direct": {"fake backend": 14.5, "clients": 8.4, "proxy": 0.01, "other": 0.1},
            "proxied": {"fake backend": 16.8, "clients": 9.8, "proxy": 12.9, "other": 0.5},
        },
    )


def test_the_summary_says_what_the_figure_means_why_it_took_longer_and_what_to_run() -> None:
    text = measured().format_summary()
    flat = " ".join(text.split())
    assert "the backend behind the proxy computed 500,000 prompt tokens instead of 2,100,000 (76.2% less prefill)" in (
        flat
    )
    assert "served 91.7% of the prompt tokens instead of 65.0%" in flat
    assert "A scenario at 0.0% saved (b) is one the proxy left as it was" in flat
    assert "Time: direct 22.2 s, through the proxy 46.4 s. Why the second is longer" in flat
    assert "  direct:            fake backend 14.5 s, clients 8.4 s, other 0.1 s; 23.0 s in all" in text
    assert "  through the proxy: fake backend 16.8 s, clients 9.8 s, proxy 12.9 s, other 0.5 s; 40.0 s in all" in text
    # The proxy's own share, said plainly: per request, of the pass, of the extra time.
    assert "The proxy's own CPU is 12.9 s, 4.6 ms a request" in flat
    assert "32% of the pass through the proxy, 76% of the extra CPU time" in flat
    # Beside what it saves: 1,600,000 prompt tokens over 2,792 requests, at 25,000 tokens/s.
    assert "573 prompt tokens of prefill a request, 22.9 ms of GPU time a request on an H100-class GPU" in flat
    assert "waited" not in flat  # wall times here are the CPU times: no note about a busy machine
    assert text.splitlines()[-len(NEXT_STEPS) :] == list(NEXT_STEPS)
    assert "prefix-proxy serve --upstream http://127.0.0.1:8000/v1" in NEXT_STEPS[-1]
    assert all(len(line) <= 110 for line in text.splitlines())


def test_a_busy_machine_is_named_and_no_cpu_figures_is_not_an_error() -> None:
    busy = measured()
    busy.phase_s = {"direct": 51.4, "proxied": 128.0}
    assert "This process waited 88.0 s for a core" in " ".join(busy.format_summary().split())
    unmeasured = measured()
    unmeasured.phase_cpu_s = {}
    text = unmeasured.format_summary()
    assert "Time: direct 22.2 s" in text and "CPU time in this process" not in text
    assert text.splitlines()[-1] == NEXT_STEPS[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread CPU time is read from /proc")
def test_thread_cpu_is_counted_per_part() -> None:
    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    spun, done = threading.Event(), threading.Event()

    def proxy_thread() -> None:
        spin(0.3)
        spun.set()
        done.wait(10)  # alive while counted

    before = thread_cpu_s(threading.current_thread())
    proxy = threading.Thread(target=proxy_thread, name="prefix-proxy")
    proxy.start()
    spin(0.2)
    assert spun.wait(10)
    after = thread_cpu_s(threading.current_thread())
    done.set()
    proxy.join()
    assert after["clients"] - before.get("clients", 0.0) >= 0.15
    assert after["proxy"] >= 0.2


def test_the_demo_output_ends_with_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sessions", "1", "--scenarios", "stable_app,dify_rag", "--no-progress"]) == 0
    out = capsys.readouterr().out
    table, _, summary = out.partition("\n\nWhat the figure means: ")
    assert table.splitlines()[-1].startswith("overall") and summary
    assert "Time: direct " in summary
    if sys.platform.startswith("linux"):
        assert "CPU time in this process, per part:" in summary and "The proxy's own CPU is" in summary
    assert out.rstrip("\n").splitlines()[-len(NEXT_STEPS) :] == list(NEXT_STEPS)
