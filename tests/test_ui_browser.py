"""The operator's page in a real headless browser (Debian's ``chromium``), after the project's workload.

Skipped when chromium is not installed (``apt-get install chromium``). Regenerate the documentation's
screenshot with ``python -m tests.test_ui_browser docs/img/ui.png``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from proxy.app import create_app
from proxy.config import Settings
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from testbed.workload import run_workload
from tests.helpers import LiveServer

ADMIN = "admin-page-key"
TENANTS = {"acme": "sk-acme-ui", "globex": "sk-globex-ui"}
# The project's workload (testbed/workload): Dify-style RAG and timestamps atop the system prompt, a
# function-calling agent, a coding agent's environment block, Open WebUI's variables mid-prompt...
SCENARIOS = {
    "acme": ["dify_rag", "timestamp_user", "fc_agent", "coding_agent", "inline_query"],
    "globex": ["open_webui", "stable_app", "append_only"],
}
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@contextmanager
def page_after_workload(sessions: int = 2) -> Iterator[LiveServer]:
    """A proxy with the page on (prompt text shown: log_prompts), after the workload of two tenants."""
    with LiveServer(create_fake_app(FakeBackendConfig())) as backend:
        settings = Settings(
            upstream=backend.url + "/v1",
            admin_api_key=ADMIN,
            log_prompts=True,
            ui={"enabled": True},
            tenants=[{"name": name, "api_key": key} for name, key in TENANTS.items()],
            budget={"session_tokens_per_window": 200_000, "tenant_tokens_per_window": 5_000_000, "window_s": 3600},
        )
        with LiveServer(create_app(settings)) as proxy:
            for tenant, scenarios in SCENARIOS.items():
                results = run_workload(
                    proxy.url + "/v1", scenarios, sessions_per_scenario=sessions, api_key=TENANTS[tenant]
                )
                assert all(r.requests and not r.errors for r in results.values()), results
            yield proxy


def page_url(proxy: LiveServer, user: str, password: str) -> str:
    return proxy.url.replace("http://", f"http://{user}:{password}@") + "/ui"


def run_chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def screenshot(binary: str, url: str, out: Path, profile: Path) -> None:
    done = run_chromium(binary, profile, f"--screenshot={out}", "--window-size=1400,1800", url)
    assert out.exists(), done.stderr[-2000:]


def dump_dom(binary: str, url: str, profile: Path) -> str:
    done = run_chromium(binary, profile, "--dump-dom", url)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture
def browser() -> str:
    binary = chromium()
    if binary is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium): the page's browser test needs it")
    return binary


def test_the_page_in_a_browser(browser: str, tmp_path: Path) -> None:
    with page_after_workload() as proxy:
        shot = tmp_path / "ui.png"
        screenshot(browser, page_url(proxy, "admin", ADMIN), shot, tmp_path / "profile")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000

        dom = dump_dom(browser, page_url(proxy, "admin", ADMIN), tmp_path / "profile")
        rows = re.findall(r'<tr class="app" data-app="[0-9a-f]+" data-tenant="(\w+)" data-model="([\w-]+)">', dom)
        assert {tenant for tenant, _ in rows} == {"acme", "globex"}
        assert len(rows) >= len(SCENARIOS["acme"]) + len(SCENARIOS["globex"]) - 2, rows
        # Dify's retrieved context atop the system prompt: found varying, moved, shown as a tagged block.
        assert "tagged block" in dom and 'class="vary moved"' in dom
        assert "&lt;context&gt;" in dom  # prompt text is text in the page, never markup
        assert "<script" not in dom
        assert '<tr class="break"' in dom and '<tr class="session"' in dom

        # A tenant's key, in the same browser: the refusal, nothing of any tenant.
        refused = dump_dom(browser, page_url(proxy, "acme", TENANTS["acme"]), tmp_path / "profile-tenant")
        assert "forbidden" in refused
        assert 'class="app"' not in refused and "globex" not in refused and "fake-model" not in refused


def main(out: str) -> int:
    binary = chromium()
    if binary is None:
        print("chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 1
    with page_after_workload(sessions=3) as proxy, tempfile.TemporaryDirectory() as profile:
        screenshot(binary, page_url(proxy, "admin", ADMIN), Path(out), Path(profile))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/img/ui.png"))
