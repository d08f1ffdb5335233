"""GET /ui, the operator's page: off by default, the admin key only (a tenant's key sees nothing),
everything escaped, prompt text only where log_prompts or capture keeps it, bound like /metrics."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.app import create_app, create_metrics_app
from proxy.config import Settings
from proxy.routes.passthrough import route_decision
from tests.helpers import LiveServer, chat_ok, stream_chat

ADMIN = "admin-secret-key"
TENANTS = [{"name": "acme", "api_key": "sk-acme-1"}, {"name": "globex", "api_key": "sk-globex-1"}]
ACME_PROMPT = "You are the ACME support bot.\nAlways answer politely.\nCite the ACME handbook."
GLOBEX_PROMPT = "You are the GLOBEX sales assistant.\nNever discuss prices.\nKeep answers short."
ON: dict[str, Any] = {"ui": {"enabled": True}, "admin_api_key": ADMIN, "tenants": TENANTS}


def conversation(system: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def traffic(server: LiveServer) -> None:
    for minute in range(3):
        system = f"Current time: 2026-05-0{minute + 1} 10:0{minute}\n{ACME_PROMPT}"
        chat_ok(server, conversation(system, f"question {minute}"), key="sk-acme-1", max_tokens=8)
    chat_ok(server, conversation(GLOBEX_PROMPT, "hello"), key="sk-globex-1", max_tokens=8)
    _, text = stream_chat(server, conversation(GLOBEX_PROMPT, "again"), key="sk-globex-1", max_tokens=8)
    assert text


def page(server: LiveServer, **options: Any) -> httpx.Response:
    return httpx.get(server.url + "/ui", timeout=30, **options)


def test_off_by_default_and_never_forwarded(make_proxy: Callable[..., LiveServer]) -> None:
    server = make_proxy(admin_api_key=ADMIN)
    assert page(server, headers={"authorization": f"Bearer {ADMIN}"}).status_code == 404
    # Not taken to the backend either, on or off (the pass-through refuses the proxy's own paths).
    state = create_app(Settings(admin_api_key=ADMIN)).state.proxy
    assert route_decision(state, "/ui") == "not_found"


def test_needs_an_admin_key() -> None:
    with pytest.raises(ValueError, match="admin_api_key"):
        Settings(ui={"enabled": True})


def test_the_admin_sees_every_app_and_a_tenant_key_sees_nothing(make_proxy: Callable[..., LiveServer]) -> None:
    server = make_proxy(**ON)
    traffic(server)

    anonymous = page(server)
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"].startswith("Basic ")
    for options in (
        {"headers": {"authorization": "Bearer sk-acme-1"}},
        {"auth": ("acme", "sk-acme-1")},
        {"auth": ("admin", "sk-globex-1")},
    ):
        refused = page(server, **options)
        assert refused.status_code == 403, options
        assert "www-authenticate" not in refused.headers
        for secret in ("acme", "globex", "ACME", "GLOBEX", "fake-model", "Current time"):
            assert secret not in refused.text.replace("admin key", ""), (options, secret)
    assert page(server, auth=("admin", "wrong")).status_code == 401
    assert page(server, headers={"authorization": "Basic !!notbase64"}).status_code == 401

    for options in ({"headers": {"authorization": f"Bearer {ADMIN}"}}, {"auth": ("anyone", ADMIN)}):
        shown = page(server, **options)
        assert shown.status_code == 200, options
        html = shown.text
        rows = re.findall(r'<tr class="app" data-app="([0-9a-f]+)" data-tenant="(\w+)" data-model="([\w-]+)">', html)
        assert sorted((tenant, model) for _, tenant, model in rows) == [
            ("acme", "fake-model"),
            ("globex", "fake-model"),
        ]
        assert "script-src 'none'" in shown.headers["content-security-policy"]
        assert shown.headers["cache-control"] == "no-store"
        assert shown.headers["x-frame-options"] == "DENY"
        # Prompt text is not kept (neither log_prompts nor capture): digests and marks only.
        assert "Always answer politely" not in html and "Current time" not in html
        assert "1 vary" in html  # the timestamp line of the ACME prompt varied
        assert 'data-tenant="acme"' in html and 'data-tenant="globex"' in html  # sessions and budgets


def test_prompt_text_is_escaped(make_proxy: Callable[..., LiveServer]) -> None:
    server = make_proxy(**ON, log_prompts=True)
    hostile = '<script>alert("x")</script>\n<img src=x onerror=alert(1)>\n' + ACME_PROMPT
    for question in ("one", "two"):
        chat_ok(
            server,
            conversation(f"{hostile}\nnonce {question}", question),
            key="sk-acme-1",
            max_tokens=8,
            headers={"authorization": "Bearer sk-acme-1", "x-session-id": f"<script>s-{question}</script>"},
        )
    html = page(server, auth=("admin", ADMIN)).text
    assert "Always answer politely" in html  # shown: log_prompts is on
    assert "<script" not in html and "<img" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html


def test_prompt_text_follows_the_capture_setting(make_proxy: Callable[..., LiveServer], tmp_path: Path) -> None:
    server = make_proxy(**ON, capture={"path": str(tmp_path / "capture.jsonl")})
    traffic(server)
    assert "Always answer politely" in page(server, auth=("admin", ADMIN)).text


def test_served_beside_metrics_on_metrics_port(fake_backend: LiveServer) -> None:
    settings = Settings(upstream=fake_backend.url + "/v1", metrics_port=1, **ON)
    app = create_app(settings)
    with LiveServer(app) as api, LiveServer(create_metrics_app(app)) as metrics:
        traffic(api)
        assert page(api, auth=("admin", ADMIN)).status_code == 404
        shown = page(metrics, auth=("admin", ADMIN))
        assert shown.status_code == 200
        assert shown.text.count('<tr class="app"') == 2
        assert page(metrics, auth=("x", "sk-acme-1")).status_code == 403
