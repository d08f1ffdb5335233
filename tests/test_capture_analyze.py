"""Shadow capture (0600, rotation, env) and ``prefix-proxy analyze`` predicting what the proxy achieves."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from bench.analyze_accuracy import measure
from proxy.analysis.captured import read_capture
from proxy.cli import main
from proxy.config import load_settings
from proxy.config_sources import ConfigError
from proxy.enginemodel import load_tokenizer
from proxy.observability.capture import CaptureWriter

SCENARIOS = ["timestamp_user", "fc_agent", "sliding_window", "append_only"]


def test_capture_file_is_private_and_rotates_by_size(tmp_path: Path) -> None:
    path = tmp_path / "capture.jsonl"
    path.write_text("")
    path.chmod(0o644)  # an existing file is narrowed: it is about to hold prompts
    writer = CaptureWriter(path, max_bytes=300, backups=2)
    for seq in range(12):
        writer.write({"seq": seq, "request": {"messages": [{"role": "user", "content": "x" * 50}]}})
    writer.close()
    rotated = sorted(p.name for p in tmp_path.iterdir())
    assert rotated == ["capture.jsonl", "capture.jsonl.1", "capture.jsonl.2"]
    for part in tmp_path.iterdir():
        assert stat.S_IMODE(part.stat().st_mode) == 0o600
        assert part.stat().st_size <= 300
    # Oldest file first: the newest records, each whole (a line is one record), none lost between files.
    oldest_first = [tmp_path / name for name in reversed(rotated)]
    kept = [json.loads(line)["seq"] for part in oldest_first for line in part.read_text().splitlines()]
    assert len(kept) >= 3 and kept == list(range(12 - len(kept), 12)), kept


def test_capture_is_off_by_default_and_set_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert load_settings().capture.path is None
    monkeypatch.setenv("PREFIX_PROXY_CAPTURE__PATH", str(tmp_path / "capture.jsonl"))
    assert load_settings().capture.path == str(tmp_path / "capture.jsonl")
    # The file holds prompts: only in a folder the operator made for it (a mistyped one is not created).
    monkeypatch.setenv("PREFIX_PROXY_CAPTURE__PATH", str(tmp_path / "missing" / "capture.jsonl"))
    with pytest.raises(ConfigError, match=r"PREFIX_PROXY_CAPTURE__PATH: the folder .* does not exist"):
        load_settings()
    assert not (tmp_path / "missing").exists()


def test_analyze_predicts_each_mode_within_3_points(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = measure(2, 0, SCENARIOS, tmp_path)
    for mode, row in result["comparison"].items():
        assert abs(row["points_off"]) <= 3, (mode, row)
    # What canonicalization is expected to change on this traffic, and the causes it removes.
    comparison, causes = result["comparison"], result["analyze"]["causes"]
    assert comparison["relocate"]["per_app"]["timestamp_user"]["predicted"] > 0.4
    assert comparison["off"]["per_app"]["timestamp_user"]["predicted"] < 0.1
    assert comparison["safe"]["per_app"]["fc_agent"]["predicted"] > 0.8
    assert causes["off"]["system_changed"]["requests"] > 0 and causes["off"]["tools_changed"]["requests"] > 0
    # Canonical tools remove the churn; what may remain is a first turn compared with another
    # conversation of the app that uses another tool suite (concurrent sessions: order varies).
    remaining = causes["safe"].get("tools_changed", {}).get("tokens_lost", 0)
    assert remaining < 0.05 * causes["off"]["tools_changed"]["tokens_lost"]
    assert causes["off"]["history_trimmed"]["requests"] > 0

    # The command itself, on the capture file the proxy wrote (mode 0600).
    capture = tmp_path / "capture.jsonl"
    assert stat.S_IMODE(capture.stat().st_mode) == 0o600
    assert len(read_capture([capture])) == result["requests"]
    assert main(["analyze", str(capture), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["modes"]) == {"off", "safe", "relocate"}
    for row in report["modes"].values():
        assert set(row) >= {"prompt_tokens", "cached_tokens", "hit_rate"}
    assert report["modes"] == result["analyze"]["modes"]
    assert main(["analyze", str(capture)]) == 0
    table = capsys.readouterr().out
    assert "relocate" in table and "Where prefill goes" in table and "timestamp_user/fake-model" in table


def test_capture_through_the_proxy_holds_what_the_client_sent_and_the_streamed_reply(tmp_path: Path) -> None:
    import httpx

    from proxy.app import create_app
    from proxy.config import Settings
    from testbed.fakevllm import FakeBackendConfig
    from testbed.fakevllm import create_app as create_fake_app
    from tests.helpers import LiveServer

    backend = LiveServer(create_fake_app(FakeBackendConfig())).start()
    capture = tmp_path / "capture.jsonl"
    proxy = LiveServer(create_app(Settings(upstream=backend.url + "/v1", capture={"path": str(capture)}))).start()
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("zeta", "alpha")]
    body = {
        "model": "fake-model",
        "messages": [{"role": "system", "content": "Now: 2024-05-01 10:00:00"}, {"role": "user", "content": "Hi"}],
        "tools": tools,
        "tool_choice": "none",
        "max_tokens": 20,
        "stream": True,
    }
    try:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            deltas = [
                json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                for line in response.iter_lines()
                if line.startswith("data: {") and json.loads(line[6:])["choices"]
            ]
    finally:
        proxy.stop()
        backend.stop()
    (record,) = read_capture([capture])
    assert record.body == body  # as the client sent it: tools in their order, nothing moved
    assert record.reply is not None and record.reply["content"] == "".join(deltas) != ""
    assert record.prompt_tokens > 0 and stat.S_IMODE(capture.stat().st_mode) == 0o600


# A bookshop's system prompt, long enough that the chat template's markers barely move its tokens per byte.
RULES = [f"Rule {i}: answer questions about shelf {i} politely, in one sentence, naming the row." for i in range(25)]
OPENING_HOURS = "Today the shop closes at 18:00, the cafe at 17:30."
FIRST_REPLY = "Yes: Dune is on shelf 3, science fiction, second row from the top."
HOLD = "Can you hold it for me until Friday afternoon?"


def capture_record(seq: int, tenant: str, messages: list[dict[str, Any]], reply: str) -> str:
    return json.dumps(
        {
            "seq": seq,
            "tenant": tenant,
            "session": f"{tenant}-1",
            "request": {"model": "m", "messages": messages},
            "response": {"message": {"role": "assistant", "content": reply}, "usage": {}},
        }
    )


def line_bytes(*lines: str) -> int:
    return sum(len(line.encode()) + 1 for line in lines)


def test_analyze_reports_the_floor_beside_each_modes_prefill(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    system = "\n".join(RULES)
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Do you have Dune?"}]
    # The same system prompt plus one new line; the user quotes the reply (seen: the backend generated it).
    second = [
        {"role": "system", "content": f"{system}\n{OPENING_HOURS}"},
        first[1],
        {"role": "assistant", "content": FIRST_REPLY},
        {"role": "user", "content": f"{FIRST_REPLY}\n{HOLD}"},
    ]
    capture = tmp_path / "capture.jsonl"
    capture.write_text(
        "\n".join(
            [
                capture_record(1, "bookshop", first, FIRST_REPLY),
                capture_record(2, "bookshop", second, "Done."),
                # Another app: the bookshop's lines are not its own, every one of its lines is new to it.
                capture_record(3, "library", first, FIRST_REPLY),
            ]
        )
        + "\n"
    )
    assert main(["analyze", str(capture), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    floor = report["floor"]
    assert floor["measure"].startswith("tokens estimated") and floor["skipped"] == 0

    first_lines = (*RULES, "Do you have Dune?")
    bookshop, library = floor["apps"]["bookshop/m"], floor["apps"]["library/m"]
    assert (bookshop["requests"], bookshop["new_lines"]) == (2, len(first_lines) + 2)
    assert bookshop["new_bytes"] == line_bytes(*first_lines) + line_bytes(OPENING_HOURS, HOLD)
    assert (library["requests"], library["new_lines"], library["new_bytes"]) == (1, 26, line_bytes(*first_lines))

    # In tokens, near the exact count of those lines (the floor is estimated from their bytes).
    tokenizer = load_tokenizer()
    first_tokens = len(tokenizer.encode("\n".join(first_lines) + "\n"))
    second_tokens = len(tokenizer.encode(f"{OPENING_HOURS}\n{HOLD}\n"))
    assert library["floor_tokens"] == pytest.approx(first_tokens, rel=0.1)
    assert bookshop["floor_tokens"] - library["floor_tokens"] == pytest.approx(second_tokens, rel=0.2)
    assert floor["overall"]["floor_tokens"] == bookshop["floor_tokens"] + library["floor_tokens"]

    # Each mode's prefill as a multiple of the floor, per app and overall.
    for mode, row in report["modes"].items():
        overall = floor["overall"]["x_floor"][mode]
        assert overall == round(row["prefill_tokens"] / floor["overall"]["floor_tokens"], 2) >= 1.0
        for app, tally in floor["apps"].items():
            assert tally["x_floor"][mode] == round(
                report["apps"][app][mode]["prefill_tokens"] / tally["floor_tokens"], 2
            )
    # The library's one request is new from its first token: nothing to win, at the floor in every mode.
    assert set(library["x_floor"].values()) == {1.0}
    # The bookshop's second request recomputes from its new line on; the multiple says what is left to win.
    assert bookshop["x_floor"]["off"] > 1.0

    # The floor belongs to the requests as sent: the same whatever modes are replayed.
    assert main(["analyze", str(capture), "--json", "--modes", "relocate"]) == 0
    assert json.loads(capsys.readouterr().out)["floor"]["apps"]["library/m"] == {
        **library,
        "x_floor": {"relocate": library["x_floor"]["relocate"]},
    }

    assert main(["analyze", str(capture)]) == 0
    table = capsys.readouterr().out
    assert "x floor" in table and floor["measure"] in table
    (bookshop_row,) = [line for line in table.splitlines() if line.startswith("bookshop/m") and "x" in line]
    assert f"{bookshop['floor_tokens']:,}" in bookshop_row and f"{bookshop['x_floor']['relocate']:.2f}x" in bookshop_row
