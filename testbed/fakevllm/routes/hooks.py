"""Test-only endpoints (not in vLLM): what the fake backend saw, and resetting it."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from testbed.fakevllm.engine import FakeEngine
from testbed.fakevllm.intake import read_model, tokenize_text
from testbed.fakevllm.protocol import Rejected, TokenizeRequest, error_response


class HookRoutes:
    """``GET /fake/requests``, ``GET /fake/stats``, ``POST /fake/reset``, ``POST /fake/cache/lookup``."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    async def fake_requests(self, limit: int | None = None, include_token_ids: bool = False) -> JSONResponse:
        """The last ``limit`` requests, oldest first (prompt ids only when asked: they are big)."""
        return JSONResponse([r.to_json(include_token_ids) for r in self.engine.log.last(limit)])

    async def fake_stats(self) -> JSONResponse:
        engine = self.engine
        cache = engine.cache
        body: dict[str, Any] = {
            **engine.streams.to_json(),
            "requests_running": engine.num_running,
            "requests_waiting": engine.num_waiting,
            "prefix_cache": {
                "block_size": cache.block_size,
                "capacity_blocks": cache.capacity_blocks,
                "cached_blocks": cache.num_cached_blocks,
                "used_blocks": cache.num_used_blocks,
                "usage": cache.usage,
                "requests": cache.stats.requests,
                "queries": cache.stats.queries,
                "hits": cache.stats.hits,
                "hit_rate": cache.stats.hit_rate,
            },
        }
        return JSONResponse(body)

    async def fake_reset(self) -> JSONResponse:
        """Forget the cache, counters (Prometheus included), request log and stream stats."""
        self.engine.reset()
        return JSONResponse({"reset": True})

    async def fake_cache_lookup(self, request: Request) -> Response:
        """Tokens of this prompt (``/tokenize`` body, plus ``cache_salt``) cached right now.

        Read-only: no counters move, no LRU position changes.
        """
        try:
            body, req = await read_model(request, TokenizeRequest)
            prompt_text, add_special = tokenize_text(req)
        except Rejected as exc:
            return error_response(exc.status, exc.message)
        ids = self.engine.tokenizer.encode(prompt_text, add_special_tokens=add_special)
        salt = body.get("cache_salt")
        cached = self.engine.cache.lookup(ids, salt if isinstance(salt, str) and salt else None)
        return JSONResponse({"prompt_tokens": len(ids), "cached_tokens": cached})
