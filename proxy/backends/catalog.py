"""What the upstream says about its models (max_model_len), cached."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import orjson

from proxy.backends.pool import BackendPool
from proxy.http import ProxyError

logger = logging.getLogger("prefix_proxy.models")


class ModelCatalog:
    def __init__(self, upstream: BackendPool, ttl_s: float = 300.0, retry_s: float = 10.0) -> None:
        self._upstream = upstream
        self._ttl = ttl_s
        self._retry = retry_s
        self._lengths: dict[str, int] = {}
        self._fresh_until = 0.0

    async def max_model_len(self, model: str) -> int | None:
        if time.monotonic() >= self._fresh_until:
            await self._refresh()
        return self._lengths.get(model)

    async def count_prompt_tokens(self, body: dict[str, Any], headers: dict[str, str]) -> int | None:
        """The exact prompt tokens from the backend's ``POST /tokenize`` (vLLM), or None if it cannot say."""
        request: dict[str, Any] = {"model": body.get("model"), "messages": body.get("messages")}
        if body.get("tools"):
            request["tools"] = body["tools"]
        try:
            response = await self._upstream.open(
                "POST",
                "/tokenize",
                content=orjson.dumps(request),
                headers={**headers, "content-type": "application/json"},
                root=True,
                model=request["model"],
            )
            raw = await self._upstream.read(response)
            count = json.loads(raw).get("count") if response.status_code == 200 else None
        except (ProxyError, ValueError, AttributeError, TypeError):
            return None
        return count if isinstance(count, int) else None

    async def _refresh(self) -> None:
        data = (await self._upstream.list_models()).data
        if data is None:
            urls = ", ".join(backend.upstream.base_url + "/models" for backend in self._upstream.backends)
            logger.warning(
                "could not read the upstream's models (GET %s): context lengths unknown until it answers", urls
            )
            self._fresh_until = time.monotonic() + self._retry
            return
        self._lengths = {
            str(m["id"]): int(m["max_model_len"])
            for m in data
            if isinstance(m, dict) and isinstance(m.get("max_model_len"), int)
        }
        self._fresh_until = time.monotonic() + self._ttl
