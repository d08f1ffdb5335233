"""The proxy's own cost as one conversation grows (issue 46): what a request does is proportional to
what it adds, not to the history it re-sends.

Counted, not timed, where a busy machine would blur it: the Python calls the app makes per request
(cProfile's count, the same on every run) at 10 and 500 turns of history, Dify-style and agent-style,
with and without a session header, with a summary in place. What is left growing is the work done in
C on the whole body (parsing it, writing it, comparing the history with the last request's once);
the chat validation of ``proxy.http.body`` is counted apart (it resumes after the system messages
that open the list, which a Dify clock changes). Then ``bench.history`` itself, small, with a
generous bound on CPU time.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from bench import history
from bench.history import Conversation
from bench.inprocess import access_log_to_devnull, send_one
from bench.servers import free_port, spawn
from proxy.app import create_app
from proxy.config import Settings

# Validation (``proxy.http.body``): a message at a time where it cannot resume.
VALIDATION = "proxy/http/body.py"


@pytest.fixture(params=[False, True], ids=["no summary", "summary in place"])
async def app(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    summary: bool = request.param
    context, usage = (history.SUMMARY_CONTEXT, history.SUMMARY_USAGE) if summary else (history.LONG_CONTEXT, 8000)
    port = free_port()
    backend = [sys.executable, "-m", "bench.instant_backend", "--port", str(port)]
    backend += ["--max-model-len", str(context), "--prompt-tokens", str(usage)]
    with spawn(backend, f"http://127.0.0.1:{port}/health"):
        overrides: dict[str, Any] = {"summarizer": {"apply_ratio": 0}} if summary else {}
        settings = Settings(upstream=f"http://127.0.0.1:{port}/v1", **overrides)
        built = create_app(settings)
        with access_log_to_devnull(settings.log_level):
            async with built.router.lifespan_context(built):
                yield built


def _calls(stats: pstats.Stats, requests: int) -> tuple[float, float]:
    """(all calls, those made in or by chat validation) per request."""
    total = validation = 0
    for where, (_, calls, _, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        total += calls
        if where[0].endswith(VALIDATION):
            validation += calls
        else:
            validation += sum(counts[1] for caller, counts in callers.items() if caller[0].endswith(VALIDATION))
    return total / requests, validation / requests


async def _per_request(app: Any, style: str, turns: int, session: bool, number: int) -> tuple[float, float]:
    conversation = Conversation(style, number, 8000)
    headers = [(b"x-session-id", f"history-cost-{number}".encode())] if session else None
    await send_one(app, orjson.dumps(conversation.body(turns - 1)), headers=headers)  # resumed here
    bodies = [orjson.dumps(conversation.body(t)) for t in range(turns, turns + 4)]
    profiler = cProfile.Profile()
    profiler.enable()
    for body in bodies:
        await send_one(app, body, headers=headers)
    profiler.disable()
    return _calls(pstats.Stats(profiler), len(bodies))


@pytest.mark.parametrize("session", [False, True], ids=["inferred", "x-session-id"])
@pytest.mark.parametrize("style", ["dify", "agent"])
async def test_python_calls_per_request_do_not_grow_with_the_history(app: Any, style: str, session: bool) -> None:
    short, short_validation = await _per_request(app, style, 10, session, 1)
    long, long_validation = await _per_request(app, style, 500, session, 2)
    # 500 turns re-send 2,000 (agent) or 1,000 (Dify) messages more than 10 do: before, tens of
    # Python calls each (about 50 times the calls at 10 turns).
    assert long - long_validation <= 1.15 * (short - short_validation) + 100, (short, long)
    # Validation resumes where the conversation's messages come back as they were sent, after the
    # system messages that open it (a Dify clock changes one on every request).
    assert long_validation <= short_validation + 20, (style, short_validation, long_validation)


async def test_bench_history_runs_small_and_a_long_conversation_costs_about_a_short_ones() -> None:
    """``bench.history`` end to end, small: a Dify conversation at 10 and 1,000 turns of history
    (1,000 turns re-send 2,000 messages: 7.5x the CPU per request before issue 46, about 2.5x after,
    the body's parsing, writing and one comparison in C included); a bound a busy machine keeps."""
    rows = history.rows_of("dify", "plain,session,summary")
    with history.started(None) as proxies:
        results = await history.measure(proxies, rows, (10, 1000), size=4, rounds=2, tokens=8000)
    for row in rows:
        short, long = results.ms("prefix-proxy", row, 10), results.ms("prefix-proxy", row, 1000)
        assert 0 < long < 5 * short, (row.name, short, long)
        applied = sum(results.cell("prefix-proxy", row, n).summarized for n in (10, 1000))
        assert applied == (16 if row.summary else 0), row.name
    table = history.table(results)
    assert "| dify plain |" in table and "dify: bare stack (no logic)" in table
