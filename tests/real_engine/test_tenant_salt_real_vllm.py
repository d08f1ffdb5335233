"""Tenant cache isolation on the real engine: vLLM accepts the proxy's per-tenant ``cache_salt`` on
chat and completion requests and shares blocks only within a tenant."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import pytest

from bench.real_vllm.engine import RealVLLM
from proxy.app import create_app
from proxy.config import Settings
from tests.helpers import LiveServer

pytestmark = pytest.mark.real_engine


def test_tenants_share_cached_blocks_only_among_themselves(real_vllm: RealVLLM) -> None:
    # Unique per run, so blocks cached by earlier tests or runs cannot answer for these.
    system = f"Run {secrets.token_hex(4)}. You are the billing assistant of a retailer. Answer briefly. " * 20
    tenants = [{"name": "acme", "api_key": "sk-acme"}, {"name": "globex", "api_key": "sk-globex"}]
    with LiveServer(create_app(Settings(upstream=real_vllm.openai_base_url, tenants=tenants))) as proxy:

        def post(path: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
            response = httpx.post(
                f"{proxy.url}/v1/{path}",
                headers={"authorization": f"Bearer {key}"},
                json={"model": real_vllm.model, "max_tokens": 4, **body},
                timeout=120,
            )
            assert response.status_code == 200, response.text
            return dict(response.json()["usage"])

        def cached(key: str, question: str) -> int:
            usage = post("chat/completions", key, {"messages": [
                {"role": "system", "content": system}, {"role": "user", "content": question}]})  # fmt: skip
            return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

        assert cached("sk-acme", "first question") == 0
        assert cached("sk-acme", "second question") > 200
        assert cached("sk-globex", "first question") == 0
        assert post("completions", "sk-acme", {"prompt": system})["prompt_tokens"] > 200
