"""Issue 47: how `prefix-proxy serve` starts and stops. An address it cannot listen on is one line
naming the setting (exit 2); SIGTERM drains (a stream in flight finishes), the drain's start and end
are logged, and a drain that finished exits 0, not 143."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import free_port
from tests.test_config_checks import one_line
from tests.test_operator_config import Served, run_cli


def test_an_address_another_process_holds_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_cli("serve", "--port", str(port), cwd=tmp_path)
        assert result.returncode == 2
        assert one_line(result) == (
            f"port: cannot listen on 127.0.0.1:{port}: Address already in use (another process listens there): "
            "stop it, or choose another port"
        )
        metrics = run_cli("serve", "--port", str(free_port()), env={"PREFIX_PROXY_METRICS_PORT": str(port)})
        assert metrics.returncode == 2
        assert one_line(metrics).startswith(f"metrics_port: cannot listen on 127.0.0.1:{port}: Address already in use")


def test_sigterm_drains_logs_it_and_exits_0(fake_backend: Any) -> None:
    served = Served(["--upstream", fake_backend.url + "/v1"], {"PREFIX_PROXY_METRICS_PORT": str(free_port())})
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "stream": True,
        "max_tokens": 40,
        "fake_options": {"chunk_delay_s": 0.03},
    }
    try:
        with (
            httpx.Client(base_url=served.url, timeout=30) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as stream,
        ):
            assert stream.status_code == 200
            lines = stream.iter_lines()
            received = [next(lines)]
            served.process.send_signal(signal.SIGTERM)
            draining = served.logged(lambda r: r.get("event") == "draining")
            received.extend(lines)
        events = [line for line in received if line]
        assert events[-1] == "data: [DONE]" and len(events) > 20, events[-3:]
        assert draining["signal"] == "SIGTERM" and draining["requests"] == 1 and draining["timeout_s"] == 30
        assert served.process.wait(timeout=15) == 0
        stopped = served.logged(lambda r: r.get("event") == "stopped")
        assert stopped["drained"] is True and stopped["level"] == "info" and stopped["seconds"] < 30
    finally:
        served.process.kill()
