"""Test-only endpoints (not in vLLM): what the fake backend saw, and resetting it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from proxy.fakebackend.engine import FakeEngine
from proxy.fakebackend.intake import read_model, tokenize_text
from proxy.fakebackend.protocol import Rejected, TokenizeRequest, error_response


def add_test_hooks(app: FastAPI, engine: FakeEngine) -> None:
    """``GET /fake/requests``, ``GET /fake/stats``, ``POST /fake/reset``, ``POST /fake/cache/lookup``."""

    @app.get("/fake/requests")
    async def fake_requests(limit: int | None = None, include_token_ids: bool = False) -> JSONResponse:
        """The last ``limit`` requests, oldest first (prompt ids only when asked: they are big)."""
        return JSONResponse([r.to_json(include_token_ids) for r in engine.log.last(limit)])

    @app.get("/fake/stats")
    async def fake_stats() -> JSONResponse:
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

    @app.post("/fake/reset")
    async def fake_reset() -> JSONResponse:
        """Forget the cache, counters (Prometheus included), request log and stream stats."""
        engine.reset()
        return JSONResponse({"reset": True})

    @app.post("/fake/cache/lookup")
    async def fake_cache_lookup(request: Request) -> Response:
        """Tokens of this prompt (``/tokenize`` body, plus ``cache_salt``) cached right now.

        Read-only: no counters move, no LRU position changes.
        """
        try:
            body, req = await read_model(request, TokenizeRequest)
            prompt_text, add_special = tokenize_text(req)
        except Rejected as exc:
            return error_response(exc.status, exc.message)
        ids = engine.tokenizer.encode(prompt_text, add_special_tokens=add_special)
        salt = body.get("cache_salt")
        cached = engine.cache.lookup(ids, salt if isinstance(salt, str) and salt else None)
        return JSONResponse({"prompt_tokens": len(ids), "cached_tokens": cached})
