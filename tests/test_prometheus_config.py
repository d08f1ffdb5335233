"""deploy/prometheus passes Prometheus' own checker, and the alert rules pass their unit tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import PROMETHEUS_HINT, require_executable

pytestmark = pytest.mark.prometheus

PROMETHEUS_DIR = Path(__file__).resolve().parents[1] / "deploy/prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = require_executable("promtool", PROMETHEUS_HINT)
    # From the config's directory, as Prometheus resolves rule_files relative to the config file.
    return subprocess.run([binary, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=120, check=False)


def test_promtool_check_config() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_unit_tests() -> None:
    """Each alert fires on the series that should fire it (deploy/prometheus/alerts_test.yml)."""
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test() -> None:
    import yaml

    alerts = {
        rule["alert"]
        for group in yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test.get("alert_rule_test", []) if case.get("exp_alerts")}
    assert alerts <= fired, f"alerts never shown firing in alerts_test.yml: {sorted(alerts - fired)}"
