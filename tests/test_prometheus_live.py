"""Every PromQL expression we ship, evaluated by a real Prometheus against a real workload.

A Prometheus server (the distribution's binary) scrapes the proxy and the fake vLLM backend every second,
with deploy/prometheus/prometheus.yml's jobs (targets swapped for the local ports) and the rules of
deploy/prometheus/alerts.yml. A workload exercises every metric family through the proxy: sessions,
streaming and non-streaming, canonicalization, a compaction, budget rejections, upstream errors and a
timeout. Then each expression of the Grafana dashboard, each dashboard variable, each recording rule and
each alert rule is evaluated through the HTTP API: it must parse, and it must return data (alert rules may
legitimately be empty: their every series selector must return data instead).
"""

from __future__ import annotations

import math
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

import proxy.app
from proxy.app import create_app
from proxy.config import Settings
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import (
    PROMETHEUS_HINT,
    LiveServer,
    chat,
    free_port,
    require_executable,
    steady_window_s,
    stream_chat,
)

pytestmark = pytest.mark.prometheus

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_YML = ROOT / "deploy/prometheus/prometheus.yml"
ALERTS_YML = ROOT / "deploy/prometheus/alerts.yml"
DASHBOARD = ROOT / "deploy/grafana/dashboards/prefix-proxy.json"

MODEL = "fake-model"
WINDOW = "1m"  # range for $__rate_interval / $__range: longer than the whole test, so it covers every sample
GRAFANA_VARIABLES = {
    "__rate_interval": WINDOW,
    "__range": WINDOW,
    "__interval": "1s",
    "model": ".*",
    "tenant": ".*",
}
KEYS = {"acme": "sk-acme-test", "globex": "sk-globex-test", "initech": "sk-initech-test"}
PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless",
    "inf", "nan", "atan2",
}  # fmt: skip


# -- the stack --------------------------------------------------------------------------------------


class Prometheus:
    def __init__(self, binary: str, workdir: Path, targets: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = yaml.safe_load(PROMETHEUS_YML.read_text())
        config["global"].update({"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"})
        config["rule_files"] = [str(ALERTS_YML)]
        targets = {**targets, "prometheus": f"127.0.0.1:{self.port}"}
        for job in config["scrape_configs"]:
            name = job["job_name"]
            assert name in targets, f"prometheus.yml has a job this test does not know: {name}"
            for key in [k for k in job if k.endswith("_sd_configs") or k == "static_configs"]:
                del job[key]
            job["static_configs"] = [{"targets": [targets[name]]}]
        config_file = workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.url, timeout=10)
        self._wait_ready(workdir / "prometheus.log")

    def _wait_ready(self, log: Path) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"prometheus exited with {self.process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if self.client.get("/-/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"prometheus did not become ready:\n{log.read_text()[-3000:]}")

    def query(self, expr: str) -> dict[str, Any]:
        response = self.client.post("/api/v1/query", data={"query": expr})
        body: dict[str, Any] = response.json()
        return body

    def value(self, expr: str) -> float | None:
        body = self.query(expr)
        result = body.get("data", {}).get("result", [])
        return float(result[0]["value"][1]) if body.get("status") == "success" and result else None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.client.close()
        self.log.close()


@dataclass
class Stack:
    prometheus: Prometheus
    proxy: LiveServer
    backend: LiveServer


def ask(
    client: httpx.Client, tenant: str, messages: list[dict[str, Any]], *, stream: bool = False, **extra: Any
) -> tuple[int, str]:
    """One chat request as ``tenant``; returns the status and the assistant's text ("" unless 200)."""
    options: dict[str, Any] = {"model": MODEL, "key": KEYS[tenant], "max_tokens": 24, **extra}
    if stream:
        response, text = stream_chat(client, messages, stream_options={"include_usage": True}, **options)
        return response.status_code, text
    response = chat(client, messages, **options)
    if response.status_code != 200:
        return response.status_code, ""
    return 200, str(response.json()["choices"][0]["message"]["content"])


def run_workload(proxy_url: str) -> dict[str, int]:
    """Traffic that makes every metric family of the proxy move; returns the count of each status."""
    statuses: dict[str, int] = {}

    def count(status: int) -> None:
        statuses[str(status)] = statuses.get(str(status), 0) + 1

    system = "You are the support assistant of ACME routers. Answer in one or two short sentences. " * 4
    with httpx.Client(base_url=proxy_url, timeout=30) as client:
        # Sessions whose system prompt starts with a timestamp: canonicalization relocates it, the
        # canonical prefix repeats, the backend serves it from cache (tokens saved by canonicalization).
        for session in range(4):
            history: list[dict[str, Any]] = []
            for turn in range(5):
                stamp = f"Current time: 2025-03-0{session + 1} 10:{turn:02d}:{(7 * turn) % 60:02d}\n"
                history.append({"role": "user", "content": f"Session {session}, question {turn}: reset model X{turn}?"})
                messages = [{"role": "system", "content": stamp + system}, *history]
                status, text = ask(client, "acme", messages, stream=turn % 2 == 1)
                count(status)
                assert status == 200
                history.append({"role": "assistant", "content": text})
        # A long conversation under a small context budget: the summarizer compacts it.
        history = [{"role": "system", "content": "You are a patient history tutor. Answer briefly."}]
        for turn in range(14):
            history.append({"role": "user", "content": f"Turn {turn}: name one cause of the Thirty Years' War."})
            status, text = ask(client, "globex", history, max_tokens=40)
            count(status)
            assert status == 200
            history.append({"role": "assistant", "content": text})
            time.sleep(0.02)
        # Budget rejections: over the context limit (400), and a session's usage budget (429).
        status, _ = ask(client, "globex", [{"role": "user", "content": "tell me everything " * 600}])
        count(status)
        assert status == 400
        history = []
        for turn in range(6):
            history.append({"role": "user", "content": f"Budget question {turn} about routers and their lights"})
            status, text = ask(client, "initech", history, max_tokens=30)
            count(status)
            if status != 200:
                break
            history.append({"role": "assistant", "content": text})
        assert status == 429
        # Upstream errors: 5xx and 4xx answers, and a timeout (the proxy waits 2.5 s).
        for code in (500, 503, 404):
            status, _ = ask(client, "acme", [{"role": "user", "content": "fail"}], fake_options={"status": code})
            count(status)
            assert status == code
        status, _ = ask(client, "acme", [{"role": "user", "content": "slow"}], fake_options={"delay_s": 3.0})
        count(status)
        assert status == 504
    return statuses


def proxy_metric(proxy_url: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in httpx.get(proxy_url + "/metrics").text.splitlines():
        if line.startswith(name) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(condition: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    binary = require_executable("prometheus", PROMETHEUS_HINT)
    backend = LiveServer(create_fake_app(FakeBackendConfig())).start()
    settings = Settings(
        upstream=backend.url + "/v1",
        upstream_timeout_s=2.5,
        kv_model="qwen2.5-7b",
        tenants=[
            {"name": "acme", "api_key": KEYS["acme"]},
            {"name": "globex", "api_key": KEYS["globex"], "budget": {"context_limit_tokens": 700}},
            {
                "name": "initech",
                "api_key": KEYS["initech"],
                "budget": {"session_tokens_per_window": 500, "window_s": steady_window_s()},
            },
        ],
        summarizer={"max_summary_tokens": 80},
    )
    patch = pytest.MonkeyPatch()
    patch.setattr(proxy.app, "GAUGE_INTERVAL_S", 0.5)  # session gauges refresh between scrapes
    server = LiveServer(create_app(settings)).start()
    prometheus = Prometheus(
        binary,
        tmp_path_factory.mktemp("prometheus"),
        {"prefix-proxy": f"127.0.0.1:{server.port}", "vllm": f"127.0.0.1:{backend.port}"},
    )
    try:
        wait_until(lambda: prometheus.value('sum(up{job=~"prefix-proxy|vllm"})') == 2, "both targets scraped")
        statuses = run_workload(server.url)
        wait_until(
            lambda: proxy_metric(server.url, "prefix_proxy_compactions_total", 'outcome="succeeded"') >= 1,
            "a compaction",
        )
        total = sum(statuses.values())
        wait_until(lambda: prometheus.value("sum(prefix_proxy_requests_total)") == total, "the last requests scraped")
        # Series born in the last scrape need a second sample before rate() sees them, and recording
        # rules another evaluation after that.
        time.sleep(3)
        yield Stack(prometheus, server, backend)
    finally:
        prometheus.stop()
        server.stop()
        backend.stop()
        patch.undo()


# -- expressions ------------------------------------------------------------------------------------


def substitute(expr: str) -> str:
    """Grafana's variables, in each of its syntaxes ($x, ${x}, ${x:fmt}, [[x]]), as a test run sees them."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name not in GRAFANA_VARIABLES:
            raise AssertionError(f"unknown Grafana variable ${name} in {expr!r}: teach this test its value")
        return GRAFANA_VARIABLES[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", value, expr)


def dashboard_panels() -> list[dict[str, Any]]:
    import json

    dashboard = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows keep their panels inside
    return panels


def dashboard_targets() -> list[tuple[str, str]]:
    return [
        (f"{panel['title']} [{target['refId']}]", target["expr"])
        for panel in dashboard_panels()
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def dashboard_variables() -> list[dict[str, Any]]:
    import json

    return [v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["type"] == "query"]


def rules(kind: str) -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS_YML.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if kind in rule]


IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
AGGREGATION_CLAUSE = re.compile(r"\s*(by|without)\s*\(")
LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}


def _skip_string(expr: str, i: int) -> int:
    quote, i = expr[i], i + 1
    while expr[i] != quote:
        i += 2 if expr[i] == "\\" and quote != "`" else 1
    return i + 1


def _skip_braces(expr: str, i: int) -> int:
    i += 1
    while expr[i] != "}":
        i = _skip_string(expr, i) if expr[i] in "\"'`" else i + 1
    return i + 1


def selectors(expr: str) -> list[str]:
    """The vector selectors of a PromQL expression (metric names with their matchers), in order."""
    found: list[str] = []
    i = 0
    while i < len(expr):
        char = expr[i]
        if char in "\"'`":
            i = _skip_string(expr, i)
        elif char == "[":  # a range or subquery: durations only
            i = expr.index("]", i) + 1
        elif char == "{":  # a selector without a metric name
            end = _skip_braces(expr, i)
            found.append(expr[i:end])
            i = end
        elif char.isdigit() or (char == "." and expr[i + 1 : i + 2].isdigit()):  # numbers, durations
            while i < len(expr) and (expr[i].isalnum() or expr[i] == "."):
                i += 1
        elif match := IDENTIFIER.match(expr, i):
            name, i = match.group(0), match.end()
            gap = len(expr[i:]) - len(expr[i:].lstrip())
            follows = expr[i + gap : i + gap + 1]
            if name.lower() in LABEL_LIST_KEYWORDS and follows == "(":
                i = expr.index(")", i) + 1
            elif follows == "(" or name.lower() in PROMQL_KEYWORDS or AGGREGATION_CLAUSE.match(expr, i):
                continue  # a function, a keyword, an aggregation written `sum by (x) (...)`
            elif follows == "{":
                end = _skip_braces(expr, i + gap)
                found.append(expr[match.start() : end])
                i = end
            else:
                found.append(name)
        else:
            i += 1
    return found


def evaluate(stack: Stack, expr: str) -> tuple[str | None, int]:
    """(error or None, number of series returned)."""
    body = stack.prometheus.query(expr)
    if body.get("status") != "success":
        return f"{body.get('errorType')}: {body.get('error')}", 0
    return None, len(body["data"]["result"])


def check_all(stack: Stack, exprs: list[tuple[str, str]], *, need_data: bool = True) -> None:
    problems = []
    for where, expr in exprs:
        error, series = evaluate(stack, substitute(expr))
        if error:
            problems.append(f"{where}: invalid: {error}\n    {expr}")
        elif need_data and series == 0:
            problems.append(f"{where}: no data\n    {expr}")
    assert not problems, "\n".join(problems)


# -- tests ------------------------------------------------------------------------------------------


def test_selector_extraction() -> None:
    expr = (
        'sum by (kind) (rate(prefix_proxy_upstream_errors_total{kind=~"unreachable|timeout"}[5m])) > 0 '
        'and on (job) up{job="vllm"} == 0 or vllm:num_requests_running offset 5m'
    )
    assert selectors(expr) == [
        'prefix_proxy_upstream_errors_total{kind=~"unreachable|timeout"}',
        'up{job="vllm"}',
        "vllm:num_requests_running",
    ]
    assert substitute("rate(x[$__rate_interval]) ${model} [[tenant]] ${tenant:regex}") == (
        f"rate(x[{WINDOW}]) .* .* .*"
    )


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    targets = dashboard_targets()
    assert len(targets) >= 20
    check_all(stack, targets)


def test_dashboard_variables_have_values(stack: Stack) -> None:
    variables = dashboard_variables()
    assert {"model", "tenant"} <= {variable["name"] for variable in variables}
    for variable in variables:
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match, f"variable {variable['name']}: unsupported query {query!r}"
        metric, label = match.groups()
        response = stack.prometheus.client.get(f"/api/v1/label/{label}/values", params={"match[]": metric})
        values = response.json()["data"]
        assert values, f"variable {variable['name']} has no values ({query})"


def test_every_recording_rule_returns_data(stack: Stack) -> None:
    check_all(stack, [(rule["record"], rule["expr"]) for rule in rules("record")])


def test_alert_rules_are_valid_and_every_selector_has_data(stack: Stack) -> None:
    alerts = rules("alert")
    assert len(alerts) >= 6
    check_all(stack, [(rule["alert"], rule["expr"]) for rule in alerts], need_data=False)
    inputs = {(f"{rule['alert']} input", selector) for rule in alerts for selector in selectors(rule["expr"])}
    check_all(stack, sorted(inputs))


def test_prometheus_evaluates_every_rule_without_error(stack: Stack) -> None:
    groups = stack.prometheus.client.get("/api/v1/rules").json()["data"]["groups"]
    loaded = [rule for group in groups for rule in group["rules"]]
    assert len(loaded) == len(rules("record")) + len(rules("alert"))
    broken = [f"{rule['name']}: {rule.get('lastError')}" for rule in loaded if rule["health"] != "ok"]
    assert not broken, broken


def test_proxy_and_vllm_hit_rates_agree(stack: Stack) -> None:
    """Both sources count the same tokens (only the timed-out request is seen by the backend alone).

    Compared on the counters' totals, not on increase(): a labelled proxy series is born at its first
    request, already holding that scrape interval's tokens, which increase() cannot see.
    """
    prom = stack.prometheus
    proxy_rate = prom.value("sum(prefix_proxy_cached_tokens_total) / sum(prefix_proxy_prompt_tokens_total)")
    vllm_rate = prom.value("sum(vllm:prefix_cache_hits_total) / sum(vllm:prefix_cache_queries_total)")
    assert proxy_rate is not None and vllm_rate is not None
    assert proxy_rate > 0.3
    assert abs(proxy_rate - vllm_rate) < 0.02, (proxy_rate, vllm_rate)
    saved = prom.value('sum(prefix_proxy_tokens_saved_total{source="canonicalization"})')
    assert saved is not None and saved > 0
    # A number, not NaN: the quantile has observations to work on (its size depends on the machine's load).
    overhead_p50 = prom.value(
        f"histogram_quantile(0.5, sum by (le) (rate(prefix_proxy_overhead_seconds_bucket[{WINDOW}])))"
    )
    assert overhead_p50 is not None and math.isfinite(overhead_p50) and overhead_p50 > 0
    assert (prom.value("max(prefix_proxy_session_kv_bytes)") or 0) > 0
    # vLLM's KV usage gauge is scraped, and as a fraction (alerts.yml fires above 0.9): 0 on the idle
    # backend, whose requests have all given their blocks back (cached-but-free blocks count as free).
    assert prom.value("max(vllm:kv_cache_usage_perc)") == 0.0
