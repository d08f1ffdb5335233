"""docs/metrics.md, the dashboard and the alert rules agree with the metrics the code defines."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from proxy.observability.metrics import Metrics
from testbed.fakevllm.metrics import BackendMetrics

ROOT = Path(__file__).resolve().parents[1]
METRICS_MD = ROOT / "docs/metrics.md"
DASHBOARD = ROOT / "deploy/grafana/dashboards/prefix-proxy.json"
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def registry(metrics: Any) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exposed name -> (type, label names) of every metric an object holds (prometheus-client's wrappers)."""
    found = {}
    for collector in list(metrics.registry._collector_to_names):  # the registry's collectors
        assert isinstance(collector, MetricWrapperBase)
        name = collector._name + {"counter": "_total", "info": "_info"}.get(collector._type, "")
        found[name] = (collector._type, tuple(collector._labelnames))
    return found


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Rows of the proxy-metrics table: exposed name -> (type, labels)."""
    section = METRICS_MD.read_text().split("## Proxy metrics", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\|\s*`(prefix_proxy_\w+)`\s*\|\s*(\w+)\s*\|([^|]*)\|", line)
        if match:
            name, kind, labels = match.groups()
            assert name not in rows, f"{name} is documented twice"
            rows[name] = (kind, tuple(re.findall(r"`(\w+)`", labels)))
    return rows


def series_names(expr: str) -> set[str]:
    """Metric names an expression reads (identifiers of our two namespaces)."""
    return set(re.findall(r"(?<![\w:])(?:prefix_proxy_\w+|vllm:\w+)(?![\w:])", expr))


def base_name(series: str, known: dict[str, Any]) -> str:
    if series in known:
        return series
    for suffix in HISTOGRAM_SUFFIXES:
        if series.endswith(suffix) and series.removesuffix(suffix) in known:
            return series.removesuffix(suffix)
    return series


def shipped_expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        (f"dashboard panel {panel['title']!r}", target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append((f"dashboard variable {variable['name']}", variable["definition"]))
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            exprs.append((f"rule {rule.get('alert') or rule.get('record')}", rule["expr"]))
    return exprs


def test_every_metric_in_the_registry_is_documented_with_its_type_and_labels() -> None:
    code, docs = registry(Metrics()), documented()
    missing = sorted(set(code) - set(docs))
    stale = sorted(set(docs) - set(code))
    assert not missing, f"metrics missing from the table in docs/metrics.md: {missing}"
    assert not stale, f"docs/metrics.md documents metrics the code does not define: {stale}"
    for name, (kind, labels) in code.items():
        assert docs[name] == (kind, labels), f"{name}: code says {kind} {labels}, docs/metrics.md {docs[name]}"


def test_documented_vllm_metrics_exist_in_the_fake_backend() -> None:
    backend = registry(BackendMetrics("m", kv_cache_usage=lambda: 0.0, num_running=lambda: 0, num_waiting=lambda: 0))
    documented_vllm = set(re.findall(r"\|\s*`(vllm:\w+)`", METRICS_MD.read_text()))
    assert documented_vllm
    assert documented_vllm <= set(backend), sorted(documented_vllm - set(backend))


@pytest.mark.parametrize(("where", "expr"), shipped_expressions())
def test_shipped_expressions_read_only_metrics_that_exist(where: str, expr: str) -> None:
    known = {
        **registry(Metrics()),
        **registry(BackendMetrics("m", kv_cache_usage=lambda: 0.0, num_running=lambda: 0, num_waiting=lambda: 0)),
    }
    for series in series_names(expr):
        name = base_name(series, known)
        assert name in known, f"{where} reads {series}, which neither the proxy nor vLLM exposes"
        if series != name:
            assert known[name][0] == "histogram", f"{where}: {series} but {name} is a {known[name][0]}"


def test_alerts_read_only_recorded_series_that_a_rule_records() -> None:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    recorded = {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}
    for group in groups:
        for rule in group["rules"]:
            for name in re.findall(r"(?<![\w:])[a-z_]+:[\w:]+", rule["expr"]):
                if not name.startswith("vllm:"):
                    assert name in recorded, f"{rule.get('alert') or rule.get('record')} reads unrecorded {name}"


def test_every_dashboard_panel_is_explained_in_the_docs() -> None:
    text = METRICS_MD.read_text()
    dashboard = json.loads(DASHBOARD.read_text())
    titles = [panel["title"] for panel in dashboard["panels"] if panel["type"] != "row"]
    missing = [title for title in titles if f"| {title} |" not in text]
    assert not missing, f"panels without a row in docs/metrics.md: {missing}"


def test_every_alert_is_explained_in_the_docs() -> None:
    text = METRICS_MD.read_text()
    alerts = [rule["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
              if "alert" in rule]  # fmt: skip
    missing = [alert for alert in alerts if f"| `{alert}` |" not in text]
    assert not missing, f"alerts without a row in docs/metrics.md: {missing}"
