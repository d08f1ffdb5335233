"""On llama-server, the proxy's summary request and the turn that first carries a summary keep to
the slot that holds their conversation.

llama-server keeps one prompt per slot (``--parallel N``). A request picks the free slot whose prompt
shares the most with its own (``--slot-prompt-similarity``, 0.10), else the least recently used free
slot, which loses the conversation it held; a request that names ``id_slot`` gets that slot, and
waits (deferred) while it is busy (tools/server/server-context.cpp ``get_available_slot`` and the
scheduling after it, llama.cpp sources of llama-cpp-python 0.3.36). ``GET /slots`` lists each
slot's ``id``, ``is_processing`` and ``n_prompt_tokens`` (its last request's prompt and completion,
less one, once done), and its ``prompt`` text only where the server was started with
``LLAMA_SERVER_SLOTS_DEBUG=1``.

The summary request extends the conversation, so it reuses the conversation's slot when that slot
is free. When the client's next turn holds it, the summary took the other slot and evicted the
conversation there. Where the slots' prompts are listed it now names the slot that holds its
conversation and waits for it. On the defaults a busy slot's size says nothing of the conversation:
the slot is found by the size the answered turn left (its prompt and completion, less one) before
that answer is released, while it is idle and holds that turn, and the summary names it. The first
turn that carries the summary shares only the system prompt with its conversation's slot, and took
the least recently used one too; it now names the slot its summary request, or the last turn, left
(found by size), where that slot is idle.

The double below is that scheduling with two slots, its prompts rendered as ChatML and counted with
tiktoken; a summary request reaches it while the conversation's next turn is in its slot (as a
client that sends the next turn at once makes it), the race this is about. What it does not model:
the host-RAM prompt cache, which would restore an evicted prompt when it comes back (at its cost),
and decoding time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.backends import Backend, BackendPool, ModelCatalog, RoundRobin
from proxy.backends.catalog import SLOT_SEARCH_S
from proxy.backends.engines import prompts_unlisted, slot_holding, slot_markers
from proxy.backends.upstream import Upstream
from proxy.config import Settings
from proxy.tokenization import TokenCounter, load_encoding
from tests.helpers import LiveServer
from tests.test_engines import LLAMA_ANSWER, LLAMA_LISTING, LLAMA_MODEL, chatml, common_prefix

N_CTX = 2048
# How long a turn keeps its slot waiting for a summary request to arrive, and a summary request
# waits for the conversation's next turn to be computing (the overlap a client that sends its next
# turn at once makes; the last turn has none).
TURN_HOLD_S = 0.15
SUMMARY_WAIT_S = 1.0


@dataclass
class Slot:
    number: int
    tokens: list[int] = field(default_factory=list)
    prompt: str = ""
    size: int = 0  # n_prompt_tokens: the last request's prompt and completion, less one
    busy: bool = False
    used_at: int = 0


class TwoSlots:
    """llama-server ``--parallel 2 --ctx-size 4096`` (two 2,048-token slots), as the proxy sees it.
    ``slots_debug``: started with ``LLAMA_SERVER_SLOTS_DEBUG=1``, its ``GET /slots`` lists each slot's
    prompt text (without it, only its size, ``n_prompt_tokens``)."""

    def __init__(self, *, slots_debug: bool = False) -> None:
        self.slots_debug = slots_debug
        self.slots = [Slot(0), Slot(1)]
        self.counter = TokenCounter()
        self.clock = 0
        self.summaries_arrived = 0
        self.slot_listings = 0  # GET /slots answered
        # Per answered request: (is a summary request, the slot, id_slot asked, prompt tokens, cached tokens).
        self.answered: list[tuple[bool, int, int, int, int]] = []
        self._changed: asyncio.Condition | None = None

    def _select(self, tokens: list[int], asked: int) -> Slot | None:
        if asked != -1:
            return self.slots[asked % len(self.slots)]
        free = [slot for slot in self.slots if not slot.busy]
        similar = [s for s in free if s.tokens and common_prefix(s.tokens, tokens) / len(tokens) > 0.1]
        if similar:
            return max(similar, key=lambda s: common_prefix(s.tokens, tokens))
        return min(free, key=lambda s: s.used_at) if free else None

    def app(self) -> Starlette:
        async def models(request: Request) -> JSONResponse:
            model = {**LLAMA_MODEL, "meta": {**LLAMA_MODEL["meta"], "n_ctx": N_CTX}}
            return JSONResponse({**LLAMA_LISTING, "data": [model]})

        async def props(request: Request) -> JSONResponse:
            return JSONResponse({"default_generation_settings": {"n_ctx": N_CTX, "params": {}}, "total_slots": 2})

        async def health(request: Request) -> JSONResponse:
            return JSONResponse({"status": "ok"})

        async def slots(request: Request) -> JSONResponse:
            self.slot_listings += 1
            listed = []
            for s in self.slots:
                slot: dict[str, Any] = {"id": s.number, "n_ctx": N_CTX, "is_processing": s.busy}
                if s.used_at:  # served a request: its size, and its prompt text where debugging
                    slot |= {"id_task": s.used_at, "n_prompt_tokens": s.size}
                    slot |= {"prompt": s.prompt} if self.slots_debug else {}
                listed.append(slot)
            return JSONResponse(listed)

        async def chat(request: Request) -> JSONResponse:
            if self._changed is None:
                self._changed = asyncio.Condition()
            changed = self._changed
            body = await request.json()
            text = chatml(body["messages"])
            tokens = load_encoding().encode_ordinary(text)
            summarizing = "summary" in str(body["messages"][-1].get("content")).lower()
            asked = body.get("id_slot", -1)
            async with changed:
                if summarizing:
                    await _wait_for(changed, lambda: any(s.busy for s in self.slots), SUMMARY_WAIT_S)
                    # Scheduled as it arrives: a slot taken now, or deferred until the one asked for is free.
                    slot = self._select(tokens, asked)
                    self.summaries_arrived += 1
                    changed.notify_all()
                else:
                    slot = self._select(tokens, asked)
                while slot is None or slot.busy:
                    await changed.wait()  # deferred: the slot asked for, or any slot, is busy
                    slot = self._select(tokens, asked)
                slot.busy = True
                changed.notify_all()
            cached = common_prefix(slot.tokens, tokens)
            reply = "Summary: drills, walls and tiles." if summarizing else "Use a masonry bit, low speed, no hammer."
            if not summarizing:
                # The turn computes while a summary request made after the previous turn arrives.
                arrived = self.summaries_arrived
                async with changed:
                    await _wait_for(changed, lambda: self.summaries_arrived > arrived, TURN_HOLD_S)
            self.clock += 1
            completion = self.counter.count_text(reply)
            slot.tokens = tokens + load_encoding().encode_ordinary(reply + "<|im_end|>")
            slot.prompt, slot.size, slot.used_at, slot.busy = text, len(tokens) + completion - 1, self.clock, False
            async with changed:
                changed.notify_all()
            self.answered.append((summarizing, slot.number, asked, len(tokens), cached))
            usage = {
                "completion_tokens": completion,
                "prompt_tokens": len(tokens),
                "total_tokens": len(tokens) + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            choice = {"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": reply}}
            return JSONResponse({**LLAMA_ANSWER, "choices": [choice], "usage": usage})

        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/props", props),
                Route("/health", health),
                Route("/slots", slots),
                Route("/v1/chat/completions", chat, methods=["POST"]),
            ]
        )


async def _wait_for(condition: asyncio.Condition, predicate: Any, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(condition.wait_for(predicate), timeout)


@pytest.fixture
def engine() -> Iterator[tuple[TwoSlots, LiveServer]]:
    """llama-server on its defaults: ``GET /slots`` lists sizes, not prompts."""
    double = TwoSlots()
    server = LiveServer(double.app()).start()
    yield double, server
    server.stop()


@pytest.fixture
def debugging_engine() -> Iterator[tuple[TwoSlots, LiveServer]]:
    """llama-server started with ``LLAMA_SERVER_SLOTS_DEBUG=1``: ``GET /slots`` lists prompts."""
    double = TwoSlots(slots_debug=True)
    server = LiveServer(double.app()).start()
    yield double, server
    server.stop()


def _conversations(engine: tuple[TwoSlots, LiveServer]) -> int:
    """:func:`_talk` through a prefix-proxy on its defaults; the slot the other conversation took."""
    double, server = engine
    proxy = LiveServer(create_app(Settings(upstream=server.url + "/v1"))).start()
    try:
        _talk(proxy)
    finally:
        proxy.stop()
    return double.answered[0][1]


def _talk(proxy: LiveServer) -> None:
    """Another conversation takes a slot, then a long one grows past the slot's context."""
    other = [
        {"role": "system", "content": "You translate recipes from French."},
        {"role": "user", "content": "Traduisez: faire revenir les oignons dans le beurre, puis deglacer au vin blanc."},
    ]
    _answer(proxy, other, "recipes")
    question = "How do I drill into a brick wall without cracking it, and which bit and speed should I use? "
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a hardware store assistant."}]
    for turn in range(16):
        messages.append({"role": "user", "content": f"Turn {turn}. " + question * 6})
        messages.append(_answer(proxy, messages, "drilling"))


def _answer(proxy: LiveServer, messages: list[dict[str, Any]], session: str) -> dict[str, Any]:
    response = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 64},
        headers={"x-session-id": session},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    message: dict[str, Any] = response.json()["choices"][0]["message"]
    return message


def test_a_summary_request_waits_for_its_conversations_slot(debugging_engine: tuple[TwoSlots, LiveServer]) -> None:
    """Where llama-server lists its slots' prompts (``LLAMA_SERVER_SLOTS_DEBUG=1``): on its defaults
    a busy slot's size says nothing of the conversation, and the summary names no slot."""
    double, _ = debugging_engine
    other_slot = _conversations(debugging_engine)
    summaries = [(slot, asked) for summarizing, slot, asked, *_ in double.answered if summarizing]
    assert summaries, "the conversation outgrew its slot: a summary was made"
    assert all(asked == slot for slot, asked in summaries), summaries  # each named its slot
    assert other_slot not in {slot for slot, _ in summaries}, "a summary evicted the other conversation"


def test_the_turn_that_first_carries_a_summary_goes_to_the_slot_its_summary_left(
    engine: tuple[TwoSlots, LiveServer],
) -> None:
    """That turn shares only the system prompt with its conversation's slot (the summary replaced the
    history): under llama-server's 0.10 similarity it would take the least recently used slot and
    evict the conversation there. It names the slot its summary request left, found on llama-server's
    defaults by its size (the summary request's prompt and completion, less one), where that slot is
    idle (it never waits for a busy one)."""
    double, _ = engine
    _conversations(engine)
    named = 0
    last_summary_slot = None
    for summarizing, slot, asked, *_ in double.answered:
        if summarizing:
            last_summary_slot = slot
        elif asked != -1:
            named += 1
            assert slot == asked == last_summary_slot
    assert named, "the first turn carrying a summary named its slot"


def test_on_defaults_a_summary_request_keeps_off_the_other_conversations_slot(
    engine: tuple[TwoSlots, LiveServer],
) -> None:
    """On llama-server's defaults (no prompt text listed): the slot is found by the size the answered
    turn left, before its answer is released (then it is idle and holds that turn; once the next turn
    computes in it, its size says nothing of the conversation). The summary request names it and
    waits for it, and so does the first turn carrying the summary, by the summary's size or the last
    turn's. Before, the summary took the other slot and evicted the conversation there (a strict xfail
    until then)."""
    double, _ = engine
    other_slot = _conversations(engine)
    summaries = [(slot, asked) for summarizing, slot, asked, *_ in double.answered if summarizing]
    assert summaries and all(asked == slot != other_slot for slot, asked in summaries), summaries
    assert all(slot != other_slot for _, slot, *_ in double.answered[1:]), double.answered


def test_without_the_slot_named_the_summary_evicts_the_other_conversation(
    debugging_engine: tuple[TwoSlots, LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the first test guards against, on the same double: the race it sets up is real."""

    async def unknown(self: ModelCatalog, *args: Any, **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(ModelCatalog, "slot_holding", unknown)
    double, _ = debugging_engine
    other_slot = _conversations(debugging_engine)
    summaries = [slot for summarizing, slot, *_ in double.answered if summarizing]
    assert other_slot in summaries
    assert "oignons" not in double.slots[other_slot].prompt


def test_a_conversation_is_found_by_its_last_question_and_the_reply_before_it() -> None:
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a hardware store assistant."},
        {"role": "user", "content": "Which anchor holds a shelf on plasterboard?"},
        {"role": "assistant", "content": "A spring toggle or a metal cavity anchor, rated for the load."},
        {"role": "user", "content": [{"type": "text", "text": "And for a heavy mirror on the same wall?"}]},
        {"role": "assistant", "content": "Two metal cavity anchors and a French cleat."},
    ]
    markers = slot_markers(history)
    assert markers == ["And for a heavy mirror on the same wall?", history[2]["content"]]
    rendered = chatml(history[:4])  # the slot served the last question; its reply is not in its prompt
    slots = [
        {"id": 0, "is_processing": False, "prompt": chatml(history[:2])},
        {"id": 1, "is_processing": True, "prompt": rendered},
        {"id": 2, "is_processing": False},  # an empty slot lists no prompt
    ]
    assert slot_holding(slots, markers) == 1
    assert slot_holding(slots, markers, idle_only=True) is None  # a turn never waits for a busy slot
    assert slot_holding([{"id": 1, "is_processing": False, "prompt": rendered}], markers, idle_only=True) == 1
    assert not prompts_unlisted(slots) and not prompts_unlisted({"error": "no slots endpoint"})
    # On llama-server's defaults a slot lists its size only: found by the tokens a request left.
    sized = [{"id": 0, "is_processing": False, "n_prompt_tokens": 51}, {"id": 1, "is_processing": False}]
    assert slot_holding(sized, markers, sizes=(51,)) == 0
    assert prompts_unlisted(sized) and prompts_unlisted([{**sized[0], "prompt": ""}])
    assert not prompts_unlisted([{"id": 0, "is_processing": False}])  # nothing served yet: nothing to tell
    assert slot_holding(sized, [], sizes=(51,)) == 0
    assert slot_holding(sized, markers, sizes=(52,)) is None
    assert slot_holding([{**sized[0], "is_processing": True}], [], idle_only=True, sizes=(51,)) is None
    assert slot_holding(slots[:1], markers) is None
    assert slot_holding({"error": "This server does not support slots endpoint."}, markers) is None
    assert slot_holding([{"id": True, "prompt": rendered}, {"id": -1, "prompt": rendered}], markers) is None
    # Text parts as llama.cpp renders them (common/chat.cpp: joined with a newline).
    parts = [{"type": "text", "text": "Which anchor holds a shelf"}, {"type": "text", "text": "on plasterboard?"}]
    assert slot_markers([{"role": "user", "content": parts}]) == ["Which anchor holds a shelf\non plasterboard?"]
    # Too short to tell conversations apart: not searched for.
    assert slot_markers([{"role": "user", "content": "thanks"}]) == []
    assert slot_markers([{"role": "assistant", "content": "Hello there, how can I help you today?"}]) == []


def test_a_server_that_lists_no_slot_prompts_is_not_asked_for_them_again(engine: tuple[TwoSlots, LiveServer]) -> None:
    """llama-server on its defaults lists slot sizes, not prompts: a search by text alone (a summary
    request's) is answered from that once seen, without a ``GET /slots`` each time; a search by size
    (a turn's) still asks."""
    double, server = engine
    _conversations(engine)
    history = [
        {"role": "user", "content": "How do I drill into a brick wall without cracking it?"},
        {"role": "assistant", "content": "Use a masonry bit at low speed, and no hammer mode on tiles."},
        {"role": "user", "content": "Which wall plug holds a shelf of books on that wall?"},
    ]

    async def ask() -> list[int | None]:
        pool = BackendPool([Backend("llama", Upstream(server.url + "/v1"))], RoundRobin())
        catalog = ModelCatalog(pool)
        await catalog.max_model_len("SmolLM2-135M-Instruct")  # the listing: llama-server
        found = [await catalog.slot_holding(history, model="SmolLM2-135M-Instruct", key=None, headers={})]
        before = double.slot_listings
        found.append(await catalog.slot_holding(history, model="SmolLM2-135M-Instruct", key=None, headers={}))
        assert double.slot_listings == before
        size = double.slots[0].size
        found.append(
            await catalog.slot_holding(history, model="SmolLM2-135M-Instruct", key=None, headers={}, sizes=(size,))
        )
        assert double.slot_listings == before + 1
        await pool.aclose()
        return found

    assert asyncio.run(ask()) == [None, None, 0]


def test_a_slot_search_that_gets_no_answer_names_no_slot_and_holds_nothing_up() -> None:
    """``GET /slots`` is asked on a turn's way (the first turn carrying a summary) and, with a shared
    store, before an answer is released: a server that does not answer it within ``SLOT_SEARCH_S``
    gets no slot named, and the request goes on (the connection's slot in the pool is released)."""

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(LLAMA_LISTING)

    async def slots(request: Request) -> JSONResponse:
        await asyncio.sleep(SLOT_SEARCH_S + 5.0)  # past the search's patience (the search gives up)
        return JSONResponse([])

    app = Starlette(routes=[Route("/v1/models", models), Route("/slots", slots)])
    server = LiveServer(app).start()

    async def ask() -> tuple[int | None, float, int]:
        pool = BackendPool([Backend("llama", Upstream(server.url + "/v1"))], RoundRobin())
        catalog = ModelCatalog(pool)
        await catalog.max_model_len(LLAMA_MODEL["id"])  # the listing: llama-server
        started = time.monotonic()
        found = await catalog.slot_holding([], model=LLAMA_MODEL["id"], key=None, headers={}, sizes=(51,))
        waited = time.monotonic() - started
        in_flight = pool.backends[0].in_flight
        await pool.aclose()
        return found, waited, in_flight

    try:
        found, waited, in_flight = asyncio.run(ask())
    finally:
        server.stop()
    assert found is None and in_flight == 0
    assert SLOT_SEARCH_S <= waited < SLOT_SEARCH_S + 2.0
