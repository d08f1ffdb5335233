"""Day one for an operator: a wrong config never runs silently, every problem is one line naming its
source (file:key, flag or variable) with exit code 2, `check-config` shows the effective settings and
where each came from, the start-up line says what the proxy found, /readyz reports each dependency,
and SIGHUP reloads tenants without dropping a stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy import __version__
from tests.helpers import free_port, wait_healthy

REDIS_DOWN = "redis://127.0.0.1:1/0"


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("PREFIX_PROXY_")}
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        env={**clean, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def config_file(tmp_path: Path, text: str, name: str = "proxy.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# Each error an operator met, and the one line they now get (a fragment of it).
CASES: list[tuple[str, str, dict[str, str], list[str]]] = [
    (
        "misspelled keys",
        "upstrem: http://127.0.0.1:18000/v1\ncanon: {mdoe: safe}\nsessions: {store: redis, redis_ulr: redis://h/0}\n",
        {},
        [
            "proxy.yaml: upstrem: unknown key (did you mean 'upstream'?)",
            "proxy.yaml: canon.mdoe: unknown key (did you mean 'mode'?)",
            "proxy.yaml: sessions.redis_ulr: unknown key (did you mean 'redis_url'?)",
        ],
    ),
    ("YAML on as a mode", "canon: {mode: on}\n", {}, ["proxy.yaml: canon.mode: true is not a mode"]),
    ("tenant without api_key", "tenants:\n  - name: acme\n", {}, ["proxy.yaml: tenants[0].api_key: required, not set"]),
    (
        "wrong types",
        "port: eighty\nbudget: {soft_ratio: 2}\ncanon: {mode: sfe}\n",
        {},
        [
            "proxy.yaml: port: input should be a valid integer",
            "proxy.yaml: budget.soft_ratio: input should be less than or equal to 1 (got 2)",
            "proxy.yaml: canon.mode: input should be 'off', 'safe' or 'relocate' (got 'sfe')",
        ],
    ),
    ("broken YAML", "canon:\n  mode: [\n", {}, ["proxy.yaml: line 3 column 1: not valid YAML"]),
    (
        "bad Redis URL",
        "sessions: {store: redis, redis_url: 'http://user:hunter2@h:6379'}\n",
        {},
        ["proxy.yaml: sessions.redis_url: a Redis URL starts with redis://"],
    ),
    (
        "upstream without a scheme",
        "upstream: 127.0.0.1:18000/v1\n",
        {},
        ["proxy.yaml: upstream: an upstream is an http(s) base URL", "write http://127.0.0.1:18000/v1"],
    ),
    (
        "a port that is no number",
        "",
        {"PREFIX_PROXY_PORT": "abc"},
        ["PREFIX_PROXY_PORT: input should be a valid integer"],
    ),
    (
        "misspelled variables",
        "",
        {"PREFIX_PROXY_UPSTREM": "http://x/v1", "PREFIX_PROXY_CANON__MDOE": "off"},
        [
            "PREFIX_PROXY_UPSTREM: unknown setting (did you mean PREFIX_PROXY_UPSTREAM?)",
            "PREFIX_PROXY_CANON__MDOE: unknown key (did you mean 'mode'?)",
        ],
    ),
]


@pytest.mark.parametrize("command", ["serve", "check-config"])
@pytest.mark.parametrize(("name", "text", "env", "expected"), CASES, ids=[c[0] for c in CASES])
def test_each_config_error_is_one_line_naming_its_source_and_exits_2(
    tmp_path: Path, command: str, name: str, text: str, env: dict[str, str], expected: list[str]
) -> None:
    args = [command, "--config", config_file(tmp_path, text)] if text else [command]
    result = run_cli(*args, env=env, cwd=tmp_path)
    assert result.returncode == 2, (name, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and "FileSettings" not in result.stderr
    assert len(lines) == len([e for e in expected if not e.startswith("write ")]) or name == "upstream without a scheme"
    for fragment in expected:
        assert any(fragment in line for line in lines), (fragment, lines)
    assert all(line.startswith("prefix-proxy: ") for line in lines)
    assert "hunter2" not in result.stderr


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("missing.yaml", "missing.yaml: config file not found"),
        ("proxy.json", "proxy.json: a config file is YAML (.yaml, .yml) or TOML (.toml), not a .json file"),
    ],
)
def test_a_missing_or_foreign_config_file_is_one_line(tmp_path: Path, name: str, expected: str) -> None:
    if name.endswith(".json"):
        (tmp_path / name).write_text('{"upstream": "http://x/v1"}')
    result = run_cli("serve", "--config", str(tmp_path / name))
    assert result.returncode == 2 and expected in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_yaml_off_is_the_mode_off_everywhere_a_mode_is_read(tmp_path: Path) -> None:
    path = config_file(
        tmp_path, "canon: {mode: off, model_modes: {m: off}}\nsummarizer: {sliding_window_repair: off}\n"
    )
    result = run_cli("check-config", "--config", path)
    assert result.returncode == 0, result.stderr
    assert f'canon.mode = "off"  [{path}: canon.mode]' in result.stdout
    assert f'canon.model_modes = {{"m": "off"}}  [{path}: canon.model_modes]' in result.stdout
    assert f'summarizer.sliding_window_repair = "off"  [{path}: summarizer.sliding_window_repair]' in result.stdout


def test_check_config_prints_every_setting_with_its_source_and_masks_secrets(tmp_path: Path) -> None:
    path = config_file(
        tmp_path,
        "canon: {mode: safe}\ntenants:\n  - {name: acme, api_key: sk-acme-secret}\n"
        "sessions: {store: redis, redis_url: 'redis://:s3cret@127.0.0.1:6379/0'}\n",
    )
    result = run_cli("check-config", "--config", path, "--port", "9001", env={"PREFIX_PROXY_BUDGET__SOFT_RATIO": "0.5"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "port = 9001  [--port]" in out
    assert "budget.soft_ratio = 0.5  [PREFIX_PROXY_BUDGET__SOFT_RATIO]" in out
    assert f'canon.mode = "safe"  [{path}: canon.mode]' in out
    assert 'host = "127.0.0.1"  [default]' in out
    assert 'sessions.redis_url = "redis://:***@127.0.0.1:6379/0"' in out
    assert "sk-acme-secret" not in out and "s3cret" not in out and '"api_key": "********"' in out


def test_a_setting_that_no_longer_does_anything_loads_and_check_config_says_so(tmp_path: Path) -> None:
    """``upstream_transport`` chose between two upstream transports; there is one now. A config that
    sets it still loads, and check-config names where it is set."""
    path = config_file(tmp_path, "upstream: http://x/v1\nupstream_transport: httpx\n")
    result = run_cli("check-config", "--config", path)
    assert result.returncode == 0, result.stderr
    assert f'upstream_transport = "httpx"  [{path}: upstream_transport]' in result.stdout
    assert f"prefix-proxy: note: {path}: upstream_transport: has no effect" in result.stderr
    variable = run_cli("check-config", env={"PREFIX_PROXY_UPSTREAM_TRANSPORT": "aiohttp"})
    assert variable.returncode == 0, variable.stderr
    assert "note: PREFIX_PROXY_UPSTREAM_TRANSPORT: has no effect" in variable.stderr
    assert "note:" not in run_cli("check-config").stderr


def test_version_and_help() -> None:
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"prefix-proxy {__version__}"
    top = run_cli("--help").stdout
    assert "``" not in top and ":mod:" not in top and "check-config" in top
    serve = run_cli("serve", "--help").stdout
    assert "listen address" in serve and "listen port" in serve
    fake = run_cli("fake-backend", "--help").stdout
    for flag in ("--block-size", "--capacity-blocks", "--max-model-len", "--prefill-ms-per-1k-tokens"):
        assert flag in fake
    assert fake.count("default") >= 6


# -- what a running proxy says -------------------------------------------------------------------


class Served:
    """``prefix-proxy serve`` in a process, its stderr (JSON log lines) collected."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("PREFIX_PROXY_")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--port", str(self.port), *args],
            env={**clean, **(env or {})},
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not wait_healthy(self.url):
            self.stop()
            raise RuntimeError("proxy did not start: " + "".join(self.lines))

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def logged(self, predicate: Any, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if predicate(record):
                    return dict(record)
            time.sleep(0.05)
        raise AssertionError("not logged; lines: " + "".join(self.lines))

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=15)


def test_start_up_line_names_what_the_proxy_found(fake_backend: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    served = Served(
        ["--upstream", fake_backend.url + "/v1", "--upstream", dead],
        {"PREFIX_PROXY_SESSIONS__STORE": "redis", "PREFIX_PROXY_SESSIONS__REDIS_URL": "redis://:pw@127.0.0.1:1/0"},
    )
    try:
        started = served.logged(lambda r: r.get("event") == "started")
        assert started["version"] == __version__ and started["listen"] == f"127.0.0.1:{served.port}"
        assert started["canon_mode"] == "relocate" and started["tenants"] == 0
        assert started["metrics"] == f"127.0.0.1:{served.port}/metrics"
        statuses = {u["url"]: u["status"] for u in started["upstreams"]}
        assert statuses == {fake_backend.url + "/v1": "up", dead: "down"}
        assert started["store"] == {"kind": "redis", "status": "down", "url": "redis://:***@127.0.0.1:1/0"}
        served.logged(lambda r: r.get("level") == "warning" and dead in r.get("message", ""))
        served.logged(lambda r: "session store redis" in r.get("message", ""))
        assert "pw@" not in "".join(served.lines)
        # /readyz: per dependency; a configured store that is down leaves the replica ready, degraded
        # (it serves without sessions meanwhile; readiness.require_store makes it 503).
        ready = httpx.get(served.url + "/readyz")
        assert ready.status_code == 200
        body = ready.json()
        assert body["status"] == "degraded" and started["readiness"] == "degraded" and started["ready"] is True
        assert body["store"] == {"kind": "redis", "status": "down"}
        assert sorted(body["backends"].values()) == ["down", "up"]
        assert body["degraded"] == ["the session store is down: serving without sessions"]
        metrics = httpx.get(served.url + "/metrics").text
        assert 'prefix_proxy_build_info{python="' in metrics and f'version="{__version__}"' in metrics
    finally:
        served.stop()


def test_an_upstream_without_its_api_path_is_named_and_not_ready(fake_backend: Any) -> None:
    wrong = f"http://127.0.0.1:{fake_backend.port}"  # no /v1: every chat request would be a 404
    served = Served(["--upstream", wrong])
    try:
        started = served.logged(lambda r: r.get("event") == "started")
        assert [u["status"] for u in started["upstreams"]] == ["wrong_path"]
        warning = served.logged(lambda r: r.get("level") == "warning" and "wrong_path" in r.get("message", ""))
        assert f"did you mean {wrong}/v1?" in warning["message"]
        ready = httpx.get(served.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["reasons"] == ["no backend serves the API"]
    finally:
        served.stop()


def test_a_setting_makes_a_replica_with_its_store_down_not_ready(fake_backend: Any) -> None:
    served = Served(
        ["--upstream", fake_backend.url + "/v1"],
        {
            "PREFIX_PROXY_SESSIONS__STORE": "redis",
            "PREFIX_PROXY_SESSIONS__REDIS_URL": REDIS_DOWN,
            "PREFIX_PROXY_READINESS__REQUIRE_STORE": "true",
        },
    )
    try:
        ready = httpx.get(served.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["store"]["status"] == "down"
        assert ready.json()["reasons"] == ["the session store is down"]
        warning = served.logged(lambda r: "session store redis" in r.get("message", ""))
        assert warning["message"].endswith("/readyz answers 503 meanwhile (readiness.require_store)")
    finally:
        served.stop()


def test_sighup_reloads_a_new_tenant_key_without_dropping_a_stream(tmp_path: Path, fake_backend: Any) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text("tenants:\n  - {name: acme, api_key: key-one}\n")
    served = Served(["--upstream", fake_backend.url + "/v1", "--config", str(path)])
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "stream": True,
        "max_tokens": 100,
        "fake_options": {"chunk_delay_s": 0.02},
    }
    try:
        with httpx.Client(base_url=served.url, timeout=30) as client:
            assert (
                client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer key-two"}).status_code
                == 401
            )
            received: list[str] = []
            with client.stream(
                "POST", "/v1/chat/completions", json=body, headers={"authorization": "Bearer key-one"}
            ) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()
                received.append(next(lines))
                # Mid-stream: a second tenant, a new mode, and a body limit (that needs a restart).
                path.write_text(
                    "tenants:\n  - {name: acme, api_key: key-one}\n  - {name: beta, api_key: key-two}\n"
                    "canon: {mode: safe}\nmax_body_bytes: 1000000\n"
                )
                served.process.send_signal(signal.SIGHUP)
                reloaded = served.logged(lambda r: r.get("event") == "reloaded")
                received.extend(lines)
            events = [line for line in received if line]
            assert events[-1] == "data: [DONE]" and len(events) > 10, events[-3:]
            assert sorted(reloaded["applied"]) == ["canon", "tenants"]
            assert reloaded["needs_restart"] == ["max_body_bytes"]
            second = dict(body, stream=False, max_tokens=8, fake_options={})
            assert (
                client.post(
                    "/v1/chat/completions", json=second, headers={"authorization": "Bearer key-two"}
                ).status_code
                == 200
            )
            # A broken file changes nothing: one line per problem, the process keeps serving.
            path.write_text("tenants:\n  - {name: acme}\n")
            served.process.send_signal(signal.SIGHUP)
            refused = served.logged(lambda r: "reload refused" in r.get("message", ""))
            assert "tenants[0].api_key: required, not set" in refused["message"]
            assert (
                client.post(
                    "/v1/chat/completions", json=second, headers={"authorization": "Bearer key-two"}
                ).status_code
                == 200
            )
        assert served.process.poll() is None
    finally:
        served.stop()


def test_a_summarizer_model_the_backends_do_not_serve_is_named_at_start(fake_backend: Any) -> None:
    """``summarizer.model`` that no backend lists: check-config cannot know (it asks no backend), so
    start-up says so, naming the key and the models there are (before: nothing, and every summary
    failed with a 404 that named neither)."""
    served = Served(["--upstream", fake_backend.url + "/v1"], {"PREFIX_PROXY_SUMMARIZER__MODEL": "no-such-model"})
    try:
        warning = served.logged(lambda r: "summarizer.model" in r.get("message", ""))
        assert warning["level"] == "warning" and "'no-such-model'" in warning["message"]
        assert "fake-model" in warning["message"]
    finally:
        served.stop()


def test_a_sighup_before_the_server_listens_does_not_end_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGHUP's default action ends a process: one sent while serve loaded its settings and built the
    app (before the server's own handler, which reloads) ended serve with 129 (a review)."""
    import proxy.cli as cli
    import proxy.serve as serving

    reached: list[str] = []

    def serve(settings: Any, reload: Any) -> None:
        os.kill(os.getpid(), signal.SIGHUP)  # where the server is not listening yet
        time.sleep(0.05)
        reached.append("after the signal")

    monkeypatch.setattr(serving, "serve", serve)
    before = signal.getsignal(signal.SIGHUP)
    try:
        assert cli.main(["serve", "--upstream", "http://127.0.0.1:9/v1"]) in (0, None)
    finally:
        signal.signal(signal.SIGHUP, before)
    assert reached == ["after the signal"]
