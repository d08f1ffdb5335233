"""Issue 47, an operator's second day: every value `serve` would trip on is checked as the settings
load, so `check-config` finds what `serve` would, and both say it in the same one line (exit 2, no
traceback) naming the key and the fix. Conflicts, duplicates and dangerous values are refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from proxy.canon import Canonicalizer
from proxy.config import Settings
from proxy.config_sources import ConfigError
from proxy.observability.capture import CaptureWriter
from proxy.preflight import check_settings, load_settings
from tests.test_operator_config import config_file, run_cli

# The mistakes of issue 47, point 1, and the one line each now gets (from check-config and serve alike).
MISTAKES: list[tuple[str, str, dict[str, str], list[str], str]] = [
    (
        "a rule regex that does not compile",
        "canon:\n  rules:\n    - {name: ticket, pattern: 'T-([0-9+'}\n",
        {},
        [],
        "proxy.yaml: canon.rules[0].pattern: not a regular expression: unterminated character set at position 3",
    ),
    (
        "log_level verbose",
        "log_level: verbose\n",
        {},
        [],
        "proxy.yaml: log_level: input should be 'debug', 'info', 'warning', 'error' or 'critical' (got 'verbose')",
    ),
    (
        "an unknown kv_model",
        "kv_model: llama-9b\n",
        {},
        [],
        "proxy.yaml: kv_model: not a model preset: did you mean 'llama-3.1-8b'? presets: llama-3.1-8b,",
    ),
    (
        "a sentinel without a port",
        "sessions: {store: redis, redis_sentinels: [sentinel-0]}\n",
        {},
        [],
        "proxy.yaml: sessions.redis_sentinels: a sentinel address is host:port or [ipv6]:port",
    ),
    (
        "tenants that are not JSON",
        "",
        {"PREFIX_PROXY_TENANTS": "notjson"},
        [],
        "PREFIX_PROXY_TENANTS: not JSON (Expecting value): this setting is a list: write it as JSON, [...]",
    ),
    ("port 70000", "port: 70000\n", {}, [], "proxy.yaml: port: a port is a number from 1 to 65535 (got 70000)"),
    ("--port -1", "", {}, ["--port", "-1"], "--port: a port is a number from 1 to 65535 (got -1)"),
    (
        "host 999.1.1.1",
        "host: 999.1.1.1\n",
        {},
        [],
        "proxy.yaml: host: not an IP address (an IPv4 address is four numbers from 0 to 255)",
    ),
    (
        "metrics_port equal to port",
        "port: 9090\nmetrics_port: 9090\n",
        {},
        [],
        "proxy.yaml: metrics_port: the same port as port (9090): /metrics needs a port of its own",
    ),
    (
        "two tenants with the same key",
        "tenants:\n  - {name: acme, api_key: sk-same}\n  - {name: beta, api_key: sk-same}\n",
        {},
        [],
        "proxy.yaml: tenants[1].api_key: the same key as tenants[0] ('acme'): one of them would never be recognized",
    ),
    (
        "a tenant's soft_ratio 5",
        "tenants:\n  - {name: acme, api_key: sk-1, budget: {soft_ratio: 5}}\n",
        {},
        [],
        "proxy.yaml: tenants[0].budget.soft_ratio: input should be less than or equal to 1 (got 5)",
    ),
    (
        "a negative timeout",
        "connect_timeout_s: -1\n",
        {},
        [],
        "proxy.yaml: connect_timeout_s: input should be greater than 0 (got -1)",
    ),
    (
        "a negative body limit",
        "max_body_bytes: -1\n",
        {},
        [],
        "proxy.yaml: max_body_bytes: input should be greater than 0 (got -1)",
    ),
    (
        "a rule with neither pattern nor markers",
        "canon:\n  rules:\n    - {name: ticket}\n",
        {},
        [],
        "proxy.yaml: canon.rules[0]: rule 'ticket' has neither a pattern nor start_marker and end_marker",
    ),
    (
        "upstream beside upstreams",
        "upstream: http://a:8000/v1\nupstreams: [http://b:8000/v1, http://c:8000/v1]\n",
        {},
        [],
        "proxy.yaml: upstream: set beside upstreams, which would replace it",
    ),
    (
        "a capture path in a folder that does not exist",
        "capture: {path: missing/capture.jsonl}\n",
        {},
        [],
        "proxy.yaml: capture.path: the folder 'missing' does not exist: create it",
    ),
    (
        "PREFIX_PROXY_CANON_MODE",
        "",
        {"PREFIX_PROXY_CANON_MODE": "off"},
        [],
        "PREFIX_PROXY_CANON_MODE: unknown setting (did you mean PREFIX_PROXY_CANON__MODE?)",
    ),
]


def one_line(result: Any) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("prefix-proxy: "), lines
    return str(lines[0].removeprefix("prefix-proxy: "))


@pytest.mark.parametrize(("name", "text", "env", "flags", "expected"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_check_config_finds_what_serve_would_and_both_say_it_in_one_line(
    tmp_path: Path, name: str, text: str, env: dict[str, str], flags: list[str], expected: str
) -> None:
    if text:
        config_file(tmp_path, text)
    args = ["--config", "proxy.yaml"] if text else []  # as an operator types it, in its folder
    check = run_cli("check-config", *args, *flags, env=env, cwd=tmp_path)
    assert check.returncode == 2, (name, check.stdout[-500:], check.stderr)
    assert one_line(check).startswith(expected), (expected, check.stderr)
    # serve: the same line, before anything binds or starts.
    served = run_cli("serve", *args, *flags, env=env, cwd=tmp_path)
    assert served.returncode == 2, (name, served.stderr)
    assert one_line(served) == one_line(check)


def test_tracing_without_its_extra_is_found_by_check_config_too(tmp_path: Path) -> None:
    """What start-up imports is imported as the settings load: check-config says it, not serve alone."""
    path = config_file(tmp_path, "tracing: {enabled: true}\n")
    lines = []
    for command in ("check-config", "serve"):
        code = (
            "import sys; sys.modules['opentelemetry.sdk.trace'] = None\n"  # as if the extra were not installed
            "from proxy.cli import main\n"
            f"sys.exit(main([{command!r}, '--config', {path!r}]))\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIX_PROXY_")}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 2, done.stderr
        lines.append(one_line(done))
    expected = (
        f"{path}: tracing.enabled: OpenTelemetry is not installed: pip install 'prefix-proxy[otel]', "
        "or set tracing.enabled false"
    )
    assert lines == [expected, expected]
    # Installed, the same file loads.
    assert load_settings(path).tracing.enabled


# -- each check, in process ----------------------------------------------------------------------------


def problems(text: str = "", tmp_path: Path | None = None, **flags: Any) -> list[str]:
    """check-config's problems for a config file holding ``text`` (none given: no file)."""
    path = config_file(tmp_path, text) if tmp_path is not None and text else None
    lines, found, _ = check_settings(path, **flags)
    assert bool(lines) != bool(found)
    return [problem.split(": ", 1)[1] if path and problem.startswith(path) else problem for problem in found]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("PREFIX_PROXY_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "canon: {rules: [{name: t, start_marker: '<t>'}]}\n",
            "canon.rules[0].end_marker: rule 't' has a start_marker but no end_marker: a marker rule needs both",
        ),
        (
            "canon: {rules: [{name: t, pattern: ''}]}\n",
            "canon.rules[0]: rule 't' has neither a pattern nor start_marker and end_marker",
        ),
        ("tenants: [{name: a, api_key: k1}, {name: a, api_key: k2}]\n", "tenants[1].name: the same name as tenants[0]"),
        ("tenants: [{name: '', api_key: k1}]\n", "tenants[0].name: string should have at least 1 character"),
        (
            "tenants: [{name: a, api_key: k1}]\nadmin_api_key: k1\n",
            "admin_api_key: the same key as tenant 'a': that tenant would hold it too",
        ),
        ("model_budgets: {m: {soft_ratio: 0}}\n", "model_budgets.m.soft_ratio: input should be greater than 0 (got 0)"),
        ("budget: {window_s: -5}\n", "budget.window_s: input should be greater than 0 (got -5)"),
        ("upstream_timeout_s: 0\n", "upstream_timeout_s: input should be greater than 0 (got 0)"),
        ("sessions: {retry_after_failure_s: -1}\n", "sessions.retry_after_failure_s: input should be greater than"),
        (
            "sessions: {store: redis, redis_cluster: true, redis_sentinels: ['s:26379']}\n",
            "sessions.redis_cluster: redis_cluster and redis_sentinels exclude each other",
        ),
        (
            "sessions: {store: redis, redis_url: 'unix:///run/redis.sock', redis_sentinels: ['s:26379']}\n",
            "sessions.redis_url: a unix:// URL cannot be combined with redis_sentinels",
        ),
        ("replicas: {share_memories: true}\n", "replicas.share_memories: needs the Redis session store"),
        ("sessions: {tenants_in_redis: true}\n", "sessions.tenants_in_redis: needs the Redis session store"),
        ("kv_dtype: fp4\n", "kv_dtype: not a KV cache dtype: one of fp32,"),
        ("kv_config_json: /nonexistent/config.json\n", "kv_config_json: cannot be read (No such file or directory)"),
        ("host: 192.0.2.1\n", "host: not an address of this machine (Cannot assign requested address)"),
        ("host: no-such-host.invalid\n", "host: no address has this name here"),
        ("metrics_host: '[::1]'\n", "metrics_host: not an IP address"),
        ("port: 9090\nmetrics_port: 9090\nmetrics_host: '0.0.0.0'\n", "metrics_port: the same port as port (9090)"),
        (
            "sessions: {ready_when_store_down: true}\nreadiness: {require_store: true}\n",
            "sessions.ready_when_store_down: contradicts readiness.require_store, which replaces it",
        ),
        # Found by tests/test_config_properties.py (configs drawn from the schema); what each did before.
        # serve: a ValueError traceback (BackendPool's own check of the header names).
        (
            "routing: {key_headers: [authorization]}\n",
            "routing.key_headers[0]: 'authorization' is a header the proxy sets itself",
        ),
        # served, and every request answered 400 by the upstream (the request's framing broken).
        (
            "routing: {key_headers: [x-router-key, transfer-encoding]}\n",
            "routing.key_headers[1]: 'transfer-encoding' is a hop-by-hop header (RFC 9110)",
        ),
        ("routing: {echo_headers: ['x(y)']}\n", "routing.echo_headers[0]: 'x(y)' is not a header name"),
        # serve: a ValueError traceback (backend names must be unique).
        (
            "upstreams: [http://a:8000/v1, http://b:8000/v1, http://a:8000/v1/]\n",
            "upstreams[2]: the backend a:8000 twice (upstreams[0] and upstreams[2]",
        ),
        # served: every request 502 (no host to connect to; port 0).
        ("upstream: 'http://:8000/v1'\n", "upstream: an upstream is an http(s) base URL"),
        ("upstream: 'http://a:0/v1'\n", "upstream: the port of an upstream URL must be a number from 1 to 65535"),
        # check-config and serve: a ValueError traceback (Invalid IPv6 URL, raised again showing the value).
        ("upstream: 'http://[::1/v1'\n", "upstream: not a URL: write an IPv6 host in brackets"),
        ("sessions: {redis_url: 'redis://[::1/0'}\n", "sessions.redis_url: not a URL: write an IPv6 host"),
        # the line named no key ("config: upstream URL ...").
        ("upstream: 'http://a:8000/v1#top'\n", "upstream: upstream URL http://a:8000/v1 has a query string"),
        # served: every request 500 (the header could not be encoded).
        ("upstream_api_key: ключ\n", "upstream_api_key: a key is sent in an HTTP header (Authorization: Bearer"),
        (
            'tenants: [{name: a, api_key: k1, upstream_api_key: "up\\nkey"}]\n',
            "tenants[0].upstream_api_key: a key is sent in an HTTP header",
        ),
        # served: the tenant's every request refused 401 (no client can present the key).
        ("tenants: [{name: a, api_key: ''}]\n", "tenants[0].api_key: empty: no client can present it"),
        ("tenants: [{name: a, api_key: ' k1'}]\n", "tenants[0].api_key: a key is sent in an HTTP header"),
        ("metrics_api_key: 'k '\n", "metrics_api_key: a key is sent in an HTTP header (Authorization: Bearer KEY)"),
        # served: a 500 on a request (OverflowError: a deque's length; infinity as an integer).
        (
            "canon: {learned_history: 9223372036854775808}\n",
            "canon.learned_history: input should be at most 9007199254740991",
        ),
        ("upstream_keepalive_s: .inf\n", "upstream_keepalive_s: input should be a finite number"),
        (
            "sessions: {operation_timeout_s: 1.0e+12}\n",
            "sessions.operation_timeout_s: a duration is at most 1000000000 seconds",
        ),
        # check-config and serve: an OverflowError traceback.
        (
            "canon: {rules: [{name: t, pattern: 'a{99999999999}'}]}\n",
            "canon.rules[0].pattern: not a regular expression Python can compile",
        ),
        # Found by a review (check-config passed, serve did what each says).
        # serve: a ValueError traceback when redis-py read the URL's query.
        (
            "sessions: {store: redis, redis_url: 'redis://127.0.0.1:6379/0?socket_timeout=abc'}\n",
            "sessions.redis_url: invalid value for 'socket_timeout' in connection URL: fix or remove that option",
        ),
        ("sessions: {redis_url: 'unix:///run/redis.sock?db=abc'}\n", "sessions.redis_url: invalid value for 'db'"),
        # serve: a PermissionError traceback opening the capture file.
        ("capture: {path: /sys/capture.jsonl}\n", "capture.path: cannot be written (Permission denied)"),
        # check-config and serve: an AttributeError traceback (a key that is a number, a boolean, nothing).
        ("1: 2\n", "1: not a setting's name"),
        ("true: 1\n", "True: not a setting's name"),
        ("null: 1\n", "None: not a setting's name"),
        # served: every request 502 (a space in the host, a trailing dot) or 404 (a space in the path).
        ("upstream: 'http://127.0.0 .1:8000/v1'\n", "upstream: '127.0.0 .1' is not a host name or address"),
        ("upstream: 'http://127.0.0.1.:8000/v1'\n", "upstream: '127.0.0.1.' is not a host name or address"),
        ("upstream: 'http://127.0.0.1:8000/v 1'\n", "upstream: the path of an upstream URL has a space"),
        ("upstream: 'http://127.0.0.1:8000/v%zz'\n", "upstream: the path of an upstream URL has a space or a %"),
        # served, and a healthy backend ejected over and over (each check waited the interval for an answer).
        ("routing: {health_check_interval_s: 0.0001}\n", "routing.health_check_interval_s: below 0.1 s the checks"),
    ],
)
def test_each_check(tmp_path: Path, text: str, expected: str) -> None:
    found = problems(text, tmp_path)
    assert len(found) == 1 and found[0].startswith(expected), (expected, found)


def test_what_the_checks_let_through(tmp_path: Path) -> None:
    """The same kinds of values, right: they load."""
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}))
    (tmp_path / "captures").mkdir()
    path = config_file(
        tmp_path,
        "log_level: WARNING\nhost: localhost\nport: 9090\nmetrics_port: 9091\nkv_config_json: "
        f"{model}\nkv_dtype: bf16\ncapture: {{path: {tmp_path / 'captures' / 'c.jsonl'}}}\n"
        "canon: {rules: [{name: a, pattern: 'T-[0-9]+'}, {name: b, start_marker: '<b>', end_marker: '</b>'}]}\n"
        "tenants: [{name: a, api_key: k1, budget: {soft_ratio: 0.5}}, {name: b, api_key: k2}]\n"
        "sessions: {store: redis, redis_sentinels: 's-0:26379,[::1]:26380'}\nkv_model: QWEN2.5-7B\n",
    )
    settings = load_settings(path)
    assert settings.log_level == "warning" and settings.metrics_port == 9091
    assert settings.sessions.redis_sentinels == ["s-0:26379", "[::1]:26380"]
    # metrics_port may equal port on another address of the machine.
    assert Settings(port=9090, metrics_port=9090, host="127.0.0.1", metrics_host="127.0.0.2").metrics_port == 9090
    # Not on another name of the same address (serve failed: address already in use, after check-config passed).
    for host, metrics_host in (("127.0.0.1", "localhost"), ("localhost", "127.0.0.1")):
        with pytest.raises(ValidationError, match="the same port as port"):
            Settings(port=9090, metrics_port=9090, host=host, metrics_host=metrics_host)


def test_a_flag_replaces_the_backends_of_the_file_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--upstream`` names the backends whichever of upstream / upstreams the file or the environment
    set: no conflict, and check-config notes what it replaced."""
    path = config_file(tmp_path, "upstreams: [http://b:8000/v1, http://c:8000/v1]\n")
    assert load_settings(path, upstream="http://a:8000/v1").upstream_urls == ["http://a:8000/v1"]
    monkeypatch.setenv("PREFIX_PROXY_UPSTREAM", "http://d:8000/v1")
    settings = load_settings(None, upstreams=["http://a:8000/v1", "http://e:8000/v1"])
    assert settings.upstream_urls == ["http://a:8000/v1", "http://e:8000/v1"]
    _, found, notes = check_settings(path, upstream="http://a:8000/v1")
    assert not found and f"{path}: upstreams: replaced by --upstream" in notes
    # Without the flag, the environment's upstream beside the file's upstreams is the conflict.
    with pytest.raises(ConfigError, match="PREFIX_PROXY_UPSTREAM: set beside upstreams"):
        load_settings(path)


def test_the_setting_readiness_replaced_still_loads_and_is_noted(tmp_path: Path) -> None:
    path = config_file(tmp_path, "sessions: {ready_when_store_down: false}\n")
    assert load_settings(path).readiness.require_store is True
    _, found, notes = check_settings(path)
    assert not found
    assert notes == [
        f"{path}: sessions.ready_when_store_down: replaced by readiness.require_store, its opposite"
        " (whose default, false, keeps a replica whose store is down ready): write "
        "readiness.require_store instead"
    ]
    assert Settings().readiness.require_store is False


def test_variables_of_sections_and_lists_say_they_are_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_PROXY_CANON__MODE", "off")  # a plain value beside: not blamed
    monkeypatch.setenv("PREFIX_PROXY_CANON__MODEL_MODES", "m=off")
    assert problems() == [
        "PREFIX_PROXY_CANON__MODEL_MODES: not JSON (Expecting value): "
        "this setting is a section: write it as JSON, {...}"
    ]


def test_a_value_the_schema_allows_works_where_it_is_used() -> None:
    """``canon.learned_apps_max: 0`` (the schema allows 0) answered every relocated request 500: a cache
    of no apps refused every insertion (found by tests/test_config_properties.py). It keeps one app now,
    as the other per-app memory reading the same setting does."""
    canonicalizer = Canonicalizer(load_settings(None, canon={"learned_apps_max": 0}).canon)
    for minute in range(3):
        system = f"You are a helpful assistant.\nCurrent time: 2024-05-01 10:0{minute}:00\nAnswer briefly."
        body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
        assert canonicalizer.apply(body, "t").body["messages"]


def test_the_capture_file_is_written_where_it_was_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``~`` in capture.path: checked in the home folder, and written there (before: in a folder
    named ``~`` under the working directory)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = Settings(capture={"path": "~/capture.jsonl"})
    assert settings.capture.path == str(tmp_path / "capture.jsonl")
    assert CaptureWriter("~/other.jsonl").path == tmp_path / "other.jsonl"


def test_a_list_given_item_by_item_in_the_environment_is_named_with_its_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PREFIX_PROXY_TENANTS__0__NAME``: the environment gives a list whole, as JSON (before: the
    line named ``tenants`` and neither the variable nor the form)."""
    monkeypatch.setenv("PREFIX_PROXY_TENANTS__0__NAME", "a")
    found = problems()
    assert found == [
        "PREFIX_PROXY_TENANTS__0__NAME (a list is one variable holding JSON: PREFIX_PROXY_TENANTS='[...]', "
        "not one per item): input should be a valid list"
    ], found


def test_a_port_this_process_cannot_bind_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Port 80 without CAP_NET_BIND_SERVICE: check-config passed and serve exited on the bind (a
    review); now check-config says so, reading what Linux reads (the first unprivileged port, the
    process's effective capabilities)."""
    import proxy.config as config

    start = tmp_path / "ip_unprivileged_port_start"
    status = tmp_path / "status"
    start.write_text("1024\n")
    monkeypatch.setattr(config, "UNPRIVILEGED_PORT_START", start)
    monkeypatch.setattr(config, "PROCESS_STATUS", status)
    status.write_text("Name:\tprefix-proxy\nCapEff:\t0000000000000000\n")  # no capability
    assert problems(port=80) == [
        "--port: port 80 needs the privilege to bind low ports (CAP_NET_BIND_SERVICE), which this process "
        "lacks: choose a port of 1024 or above (8080 is the default), or grant the capability (got 80)"
    ]
    assert problems(port=8080) == []
    status.write_text("Name:\tprefix-proxy\nCapEff:\t0000000000000400\n")  # CAP_NET_BIND_SERVICE
    assert problems(port=80) == []


# -- a review of configs that passed check-config and then failed serve (session 30) ----------------------


@pytest.mark.parametrize(
    ("text", "start"),
    [
        ("sessions: {header: x-a, headers: {1: b}}\n", "sessions.headers: "),  # was an AttributeError traceback
        ("sessions: {header: [x-a]}\n", "sessions: header: one header name"),  # was the header "['x-a']"
        ("sessions: {headers: ['x a']}\n", "sessions.headers: 'x a' is not a header name"),
    ],
)
def test_session_header_settings_are_one_line(tmp_path: Path, text: str, start: str) -> None:
    found = problems(text, tmp_path)
    assert len(found) == 1 and found[0].startswith(start), found


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis://127.0.0.1:6379/3", "Argument 'db' must be 0 or None in cluster mode"),
        ("unix:///tmp/redis.sock", "Unix domain socket is not supported in cluster mode"),
    ],
)
def test_a_redis_cluster_url_serve_cannot_use_is_named(tmp_path: Path, url: str, why: str) -> None:
    """serve made the cluster client and exited on redis-py's exception (a Helm value could do it):
    check-config makes the client as serve does, without connecting."""
    found = problems(f"sessions: {{store: redis, redis_cluster: true, redis_url: '{url}'}}\n", tmp_path)
    assert len(found) == 1 and found[0].startswith("sessions.redis_url: redis-py refuses it: " + why), found
    assert problems(f"sessions: {{store: redis, redis_url: '{url}'}}\n", tmp_path) == []


def test_a_redis_protocol_version_redis_py_refuses_is_named(tmp_path: Path) -> None:
    """?protocol=4 passed both and the store was then down forever, said to be not answering."""
    found = problems("sessions: {store: redis, redis_url: 'redis://127.0.0.1:6379/0?protocol=4'}\n", tmp_path)
    assert len(found) == 1 and "protocol must be either 2 or 3" in found[0], found


@pytest.mark.parametrize("endpoint", ["http://[::1", "collector:4318", "http://c:99999", "ftp://c:4318"])
def test_a_collector_url_the_exporter_cannot_use_is_named(tmp_path: Path, endpoint: str) -> None:
    found = problems(f'tracing: {{enabled: true, endpoint: "{endpoint}"}}\n', tmp_path)
    assert len(found) == 1 and found[0].startswith("tracing.endpoint: "), found


def test_a_collector_url_as_the_exporters_take_it_passes(tmp_path: Path) -> None:
    assert problems('tracing: {enabled: true, endpoint: "http://collector:4318"}\n', tmp_path) == []
    assert problems('tracing: {enabled: true, exporter: otlp-grpc, endpoint: "collector:4317"}\n', tmp_path) == []


def test_a_mapping_key_in_a_variables_name_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment's names are read in lower case: a model's name given in one never matched the
    model (``Qwen/...`` became ``qwen/...``) and check-config said OK."""
    monkeypatch.setenv("PREFIX_PROXY_MODEL_BUDGETS__Qwen/Qwen2.5-7B-Instruct__SOFT_RATIO", "0.5")
    monkeypatch.setenv("PREFIX_PROXY_CANON__MODEL_MODES__MyModel", "safe")
    found = problems()
    assert len(found) == 2, found
    assert all("give the whole mapping as JSON" in line for line in found), found
    monkeypatch.delenv("PREFIX_PROXY_MODEL_BUDGETS__Qwen/Qwen2.5-7B-Instruct__SOFT_RATIO")
    monkeypatch.delenv("PREFIX_PROXY_CANON__MODEL_MODES__MyModel")
    monkeypatch.setenv("PREFIX_PROXY_CANON__MODEL_MODES", '{"MyModel": "safe"}')
    assert problems() == []
    assert load_settings().canon.model_modes == {"MyModel": "safe"}
    # A key in lower case is read as written: still given this way.
    monkeypatch.delenv("PREFIX_PROXY_CANON__MODEL_MODES")
    monkeypatch.setenv("PREFIX_PROXY_CANON__MODEL_MODES__llama3", "safe")
    assert problems() == []
    assert load_settings().canon.model_modes == {"llama3": "safe"}


def test_a_key_given_twice_is_named(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys: the first section was silently not applied."""
    found = problems("canon:\n  mode: safe\ncanon:\n  relocate_target: system_end\n", tmp_path)
    assert len(found) == 1 and "'canon' is given twice in one mapping" in found[0] and "line 3" in found[0], found
    # Merged keys (anchors) are the mapping's to override.
    text = "canon: {<<: {mode: safe, relocate_target: system_end}, mode: relocate}\n"
    assert problems(text, tmp_path) == []


def test_the_docs_name_only_variables_the_proxy_reads() -> None:
    """A variable the docs tell users to export must not be one the proxy refuses at start (the
    Codex recipe named PREFIX_PROXY_API_KEY for the client's key)."""
    from proxy.config import CONFIG_FILE_ENV
    from proxy.config_sources import variable_names

    known = {f"PREFIX_PROXY_{name.upper()}" for name in variable_names(Settings)} | {CONFIG_FILE_ENV}
    root = Path(__file__).resolve().parent.parent
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for line in path.read_text(encoding="utf-8").splitlines():
            for name in re.findall(r"PREFIX_PROXY_[A-Z0-9_]*[A-Z0-9]", line):
                if name not in known and "did you mean" not in line and "__0__" not in name:
                    raise AssertionError(f"{path.name}: {name} is no setting: {line.strip()[:160]}")


def service_link_environment(service: str, address: str, ports: list[tuple[str | None, int]]) -> dict[str, str]:
    """What the kubelet puts in every pod's environment for a Service of its namespace
    (pkg/kubelet/envvars: the name upper-cased, '-' as '_'; the first port is the service's port)."""
    stem = service.upper().replace("-", "_")
    env = {f"{stem}_SERVICE_HOST": address, f"{stem}_SERVICE_PORT": str(ports[0][1])}
    env[f"{stem}_PORT"] = f"tcp://{address}:{ports[0][1]}"
    for name, port in ports:
        if name:
            env[f"{stem}_SERVICE_PORT_{name.upper().replace('-', '_')}"] = str(port)
        url = f"{stem}_PORT_{port}_TCP"
        env.update({url: f"tcp://{address}:{port}", f"{url}_PROTO": "tcp", f"{url}_PORT": str(port)})
        env[f"{url}_ADDR"] = address
    return env


# Services an operator names in the proxy's namespace: the proxy's own (the chart's and deploy/k8s's
# name), one for its metrics port, and the Redis beside it.
SERVICE_LINKS = {
    **service_link_environment("prefix-proxy", "10.96.0.12", [("http", 8080), ("metrics", 9091)]),
    **service_link_environment("prefix-proxy-metrics", "10.96.0.13", [(None, 9091)]),
    **service_link_environment("prefix-proxy-redis", "10.96.0.14", [("redis", 6379)]),
}


def test_kubernetes_service_links_are_not_read_as_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Service named prefix-proxy gives every pod started after it PREFIX_PROXY_PORT=tcp://...: read
    as the listen port, it failed check-config and serve alike (every restarted pod crashed). Links
    are recognized as Kubernetes writes them and noted, not read."""
    for name, value in SERVICE_LINKS.items():
        monkeypatch.setenv(name, value)
    settings = load_settings(None)
    assert (settings.port, settings.metrics_port) == (8080, None)
    lines, found, notes = check_settings(None)
    assert lines and not found
    assert len(notes) == 1 and notes[0].endswith(
        "not read: Kubernetes sets these for a Service in the pod's namespace (service links; set "
        "enableServiceLinks: false in the pod spec to leave them out)"
    )
    assert set(notes[0].split(": ", 1)[0].split(", ")) == set(SERVICE_LINKS)
    result = run_cli("check-config", env=SERVICE_LINKS)
    assert result.returncode == 0, result.stderr


def test_a_setting_given_beside_service_links_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod's own env replaces a link of the same name: the operator's port is a setting; the
    rest of the family is still a link, and a misspelt setting is still named."""
    env = {**SERVICE_LINKS, "PREFIX_PROXY_PORT": "9000", "PREFIX_PROXY_METRICS_PORT": "9191"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = load_settings(None)
    assert (settings.port, settings.metrics_port) == (9000, 9191)
    monkeypatch.setenv("PREFIX_PROXY_SERVICE_HOSTS", "x")
    monkeypatch.setenv("PREFIX_PROXY_PORT_8080_TCP_ADDRESS", "10.96.0.12")
    with pytest.raises(ConfigError) as raised:
        load_settings(None)
    assert [p.split(":", 1)[0] for p in raised.value.problems] == [
        "PREFIX_PROXY_PORT_8080_TCP_ADDRESS",
        "PREFIX_PROXY_SERVICE_HOSTS",
    ]


def test_an_address_shaped_value_without_its_service_is_a_setting_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a family Kubernetes wrote (its SERVICE_HOST beside an address) is skipped: the same value
    on its own is the operator's, and wrong."""
    monkeypatch.setenv("PREFIX_PROXY_PORT", "tcp://10.96.0.12:8080")
    with pytest.raises(ConfigError, match="PREFIX_PROXY_PORT: input should be a valid integer"):
        load_settings(None)


@pytest.mark.parametrize("pattern", ["DELETE\t/models", " DELETE /models", "no-slash", "", "/v1/ x"])
def test_a_route_pattern_that_could_match_nothing_is_named(tmp_path: Path, pattern: str) -> None:
    """A pattern is a path from / or a method, a space and a path: anything else loaded and silently
    matched no request (an admin route left open)."""
    found = problems(f"routes:\n  admin_routes: [{json.dumps(pattern)}]\n", tmp_path)
    assert len(found) == 1 and found[0].startswith("routes.admin_routes: ") and "is not a route pattern" in found[0]
    assert problems("routes:\n  admin_routes: ['delete /models', '/slots/*', '*']\n", tmp_path) == []
