"""``prefix-proxy demo``: options, table, JSON and progress output."""

from __future__ import annotations

import io
import json

import pytest

from proxy.progress import ProgressBar
from testbed.demo import main


def test_json_output_for_a_small_run(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--sessions", "1", "--scenarios", "stable_app,dify_rag", "--seed", "3", "--json"])
    assert code == 0
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert data["sessions_per_scenario"] == 1 and data["seed"] == 3 and data["block_size"] == 16
    assert data["scenarios"] == ["stable_app", "dify_rag"]
    for side in ("direct", "proxied"):
        assert set(data[side]) == {"stable_app", "dify_rag", "overall"}
        row = data[side]["overall"]
        assert row["errors"] == 0
        assert row["prefill_tokens"] == row["prompt_tokens"] - row["cached_tokens"]
    assert "direct" in out.err and "proxied" in out.err  # progress, one line per phase


def test_table_output_and_block_size(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--sessions", "1", "--scenarios", "fc_agent", "--block-size", "32", "--no-progress"])
    assert code == 0
    out = capsys.readouterr()
    assert "32-token blocks" in out.out
    lines = out.out.splitlines()
    assert any(line.startswith("fc_agent") for line in lines)
    assert any(line.startswith("overall") for line in lines)
    assert "hit" in out.out and "prefill saved" in out.out
    assert out.err == ""


def test_unknown_scenario_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenarios", "nope", "--no-progress"]) == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_progress_bar_draws_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    bar = ProgressBar(stream, width=10)
    update = bar.start("direct")
    update(5, 10)
    bar.finish(10)
    text = stream.getvalue()
    assert "\rdirect   [#####.....] 5/10 requests" in text
    assert text.endswith("\n") and "10 requests in" in text
