"""The product stands alone: with ``testbed`` (the development tooling) unimportable, every command but
``demo`` and ``fake-backend`` works, the app serves requests and ``analyze`` replays a capture, giving
the same report as with testbed there. Those two commands say in one line that they need it.

Each check runs in a fresh interpreter (``python -c``) whose first meta-path finder refuses ``testbed``
and records every attempt: a product module that imports it, even lazily and with the error caught, is
caught here (the import contract in pyproject.toml says the same statically)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ATTEMPTED = "testbed imports attempted:"

BLOCK_TESTBED = f"""
import atexit, sys
from importlib.abc import MetaPathFinder

class NoTestbed(MetaPathFinder):
    attempts = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "testbed":
            NoTestbed.attempts.append(name)
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NoTestbed())
atexit.register(lambda: NoTestbed.attempts and print({ATTEMPTED!r}, NoTestbed.attempts, file=sys.stderr))
"""

RUN_CLI = "from proxy.cli import main; sys.exit(main(sys.argv[1:]))"

SERVE_A_REQUEST = """
from fastapi.testclient import TestClient
from proxy.app import create_app
from proxy.config import Settings

with TestClient(create_app(Settings(upstream="http://127.0.0.1:9/v1"))) as client:
    health = client.get("/healthz")
    chat = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
print(health.status_code, chat.status_code, chat.json()["error"]["code"])
"""

SYSTEM = (
    "You are the support assistant of a small bookshop. Answer in two sentences at most, name the shelf "
    "a book is on when you know it, and say so plainly when you do not. Opening hours: 9 to 18."
)


def python(code: str, *args: str, block: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PREFIX_PROXY_")}
    program = (BLOCK_TESTBED if block else "import sys\n") + code
    return subprocess.run(
        [sys.executable, "-c", program, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    assert ATTEMPTED not in result.stderr, result.stderr
    return result.stdout


def test_the_blocker_blocks() -> None:
    blocked = python("import testbed.fakevllm")
    assert blocked.returncode != 0 and "No module named 'testbed'" in blocked.stderr
    assert ATTEMPTED in blocked.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--version"], "prefix-proxy "),
        (["--help"], "analyze"),
        (["serve", "--help"], "--upstream"),
        (["check-config"], "upstream"),
        (["analyze", "--help"], "--capacity-blocks"),
        (["kv", "--model", "llama-3.1-8b"], "llama-3.1-8b"),
        (["ramp", "--help"], "concurrency"),
        (["demo", "--help"], "--sessions"),
        (["fake-backend", "--help"], "--prefill-ms-per-1k-tokens"),
    ],
)
def test_commands_work_without_testbed(args: list[str], says: str) -> None:
    assert says in ok(python(RUN_CLI, *args))


@pytest.mark.parametrize("command", ["demo", "fake-backend"])
def test_the_commands_that_need_testbed_say_so_in_a_line(command: str) -> None:
    result = python(RUN_CLI, command)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()[:1]
    assert line.startswith(f"prefix-proxy {command}: needs the development tooling (testbed/)")
    assert "Traceback" not in result.stderr


def test_the_app_serves_requests_without_testbed() -> None:
    # The request path end to end: /healthz, and a chat request forwarded to an upstream that is down.
    assert ok(python(SERVE_A_REQUEST)).split() == ["200", "502", "upstream_unreachable"]


def capture_line(seq: int, messages: list[dict[str, Any]], reply: str) -> str:
    return json.dumps(
        {
            "seq": seq,
            "tenant": "bookshop",
            "session": "s1",
            "request": {"model": "m", "messages": messages},
            "response": {
                "message": {"role": "assistant", "content": reply},
                "usage": {"prompt_tokens": 60 + 20 * seq, "cached_tokens": 16 * seq},
            },
        }
    )


def test_analyze_replays_a_capture_without_testbed(tmp_path: Path) -> None:
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    lines = []
    questions = ["Do you have Dune?", "And the sequel, Dune Messiah?", "Can you hold both until Friday?"]
    for seq, question in enumerate(questions):
        history.append({"role": "user", "content": question})
        reply = f"Yes: shelf {seq + 3}, science fiction, second row from the top."
        lines.append(capture_line(seq, list(history), reply))
        history.append({"role": "assistant", "content": reply})
    capture = tmp_path / "capture.jsonl"
    capture.write_text("\n".join(lines) + "\n")

    analyze = RUN_CLI.replace("sys.argv[1:]", "['analyze', sys.argv[1], '--json']")
    report = json.loads(ok(python(analyze, str(capture))))
    assert set(report["modes"]) == {"off", "safe", "relocate"}
    for row in report["modes"].values():
        assert row["requests"] == 3 and row["skipped"] == 0
        assert 0 < row["cached_tokens"] < row["prompt_tokens"]  # later turns reuse the conversation's blocks
    assert report["tokenizer"] == "cl100k_base+chatml" and report["captured"]["requests"] == 3
    # The same replay as with the fake vLLM's package importable: nothing of it comes from testbed.
    assert json.loads(ok(python(analyze, str(capture), block=False))) == report

    # The replay's API directly, as a script would use it.
    direct = python(
        "from proxy.analysis.captured import read_capture\n"
        "from proxy.analysis.replay import replay\n"
        "from proxy.enginemodel.tokenizer import load_tokenizer\n"
        "result = replay(read_capture([sys.argv[1]]), 'safe', load_tokenizer())\n"
        "print(result.total.requests, result.total.prompt_tokens, result.total.cached_tokens)",
        str(capture),
    )
    safe = report["modes"]["safe"]
    assert ok(direct).split() == [str(safe["requests"]), str(safe["prompt_tokens"]), str(safe["cached_tokens"])]
