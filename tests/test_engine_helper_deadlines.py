"""The engine's helper routes the proxy asks on a turn's way are waited for a bounded time.

``POST /tokenize`` (exact token counts, ``budget.exact_counts_via_tokenize``) and llama-server's
``POST /apply-template`` go through the upstream client, whose read timeout is the engine's whole
answer's (``upstream_timeout_s``, 600 s): an engine that does not answer them must not hold the turn
that long. Past ``HELPER_TIMEOUT_S`` the count is unknown and the turn goes on with its estimate.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.backends import Backend, BackendPool, ModelCatalog, RoundRobin
from proxy.backends import catalog as catalog_module
from proxy.backends.upstream import Upstream
from tests.helpers import LiveServer

HELPER_TIMEOUT_S = 0.3
HANG_S = 3.0


def _engine(hang_s: float) -> Starlette:
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]})

    async def tokenize(request: Request) -> JSONResponse:
        await asyncio.sleep(hang_s)
        return JSONResponse({"count": 12, "tokens": list(range(12))})

    return Starlette(routes=[Route("/v1/models", models), Route("/tokenize", tokenize, methods=["POST"])])


def _count(server: LiveServer) -> tuple[int | None, float, int]:
    async def ask() -> tuple[int | None, float, int]:
        pool = BackendPool([Backend("vllm", Upstream(server.url + "/v1"))], RoundRobin())
        catalog = ModelCatalog(pool)
        body = {"model": "m", "messages": [{"role": "user", "content": "How long is this prompt?"}]}
        started = time.monotonic()
        count = await catalog.count_prompt_tokens(body, {})
        waited = time.monotonic() - started
        in_flight = pool.backends[0].in_flight
        await pool.aclose()
        return count, waited, in_flight

    return asyncio.run(ask())


def test_a_tokenize_that_does_not_answer_leaves_the_count_unknown_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog_module, "HELPER_TIMEOUT_S", HELPER_TIMEOUT_S)
    with LiveServer(_engine(HANG_S)) as server:
        count, waited, in_flight = _count(server)
    assert count is None and in_flight == 0
    assert HELPER_TIMEOUT_S <= waited < HANG_S


def test_a_tokenize_that_answers_in_time_gives_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog_module, "HELPER_TIMEOUT_S", HELPER_TIMEOUT_S)
    with LiveServer(_engine(0.0)) as server:
        count, _, in_flight = _count(server)
    assert count == 12 and in_flight == 0
