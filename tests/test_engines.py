"""Engines told apart and read in their own terms (proxy.backends.engines), against the answers
llama-server (llama.cpp sources of llama-cpp-python 0.3.36: tools/server/server-context.cpp,
server-task.cpp; its listing, context error and chat answer recorded from the real server built from
them) and vLLM give, as they write them; and a conversation that outgrows a
small llama-server context kept going by the proxy on its defaults.

The llama-server double serves what the proxy reads: ``GET /v1/models`` (``owned_by: "llamacpp"``,
``meta.n_ctx`` per slot), ``/props``, ``/health``, ``/apply-template`` and ``/tokenize``, and chat
completions that refuse a prompt past ``n_ctx`` with its 400 ``exceed_context_size_error``; tokens are
counted with tiktoken over the rendered messages, as a tokenizer of its own would. It caches as
llama-server does with one slot (``--parallel 1``): the slot keeps the last prompt and what it generated,
a request reuses their longest common prefix (``cached_tokens``), and a request that keeps less than half
of the slot's prompt saves it to the host-RAM prompt cache and loads the best one kept there
(server-context.cpp ``get_available_slot``, server-task.cpp ``server_prompt_cache::load``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.backends.engines import (
    LLAMA_SERVER,
    OLLAMA,
    VLLM,
    context_of,
    context_overflow,
    engine_of,
    ollama_context,
    props_context,
)
from proxy.config import Settings
from proxy.tokenization import TokenCounter, load_encoding
from summarizer import kept_when_used, requests_until_used
from summarizer.anchor import is_summary_message
from tests.helpers import LiveServer

# Recorded from a real llama-server (build b1-0c1e570, the llama.cpp sources in llama-cpp-python 0.3.36's
# sdist; SmolLM2-135M-Instruct Q4_1, --ctx-size 2048 --parallel 1 --alias SmolLM2-135M-Instruct), as it
# wrote them: GET /v1/models (an Ollama-style "models" list beside OpenAI's "data"), the error of a
# prompt past the slot's context, and a chat answer (usage with cached_tokens, and its own timings).
LLAMA_MODEL: dict[str, Any] = {
    "id": "SmolLM2-135M-Instruct",
    "aliases": ["SmolLM2-135M-Instruct"],
    "tags": [],
    "object": "model",
    "created": 1796428348,
    "owned_by": "llamacpp",
    "meta": {
        "vocab_type": 2,
        "n_vocab": 49152,
        "n_ctx": 2048,
        "n_ctx_train": 8192,
        "n_embd": 576,
        "n_params": 134515008,
        "size": 96576768,
        "ftype": "Q4_1",
    },
}
LLAMA_LISTING = {
    "models": [
        {
            "name": "SmolLM2-135M-Instruct",
            "model": "SmolLM2-135M-Instruct",
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": ["completion"],
            "parameters": "",
            "details": {
                "parent_model": "",
                "format": "gguf",
                "family": "",
                "families": [""],
                "parameter_size": "",
                "quantization_level": "",
            },
        }
    ],
    "object": "list",
    "data": [LLAMA_MODEL],
}
LLAMA_ANSWER: dict[str, Any] = {
    "choices": [
        {
            "finish_reason": "length",
            "index": 0,
            "message": {"role": "assistant", "content": "I'm glad you're enjoying the chat"},
        }
    ],
    "created": 1796428354,
    "model": "SmolLM2-135M-Instruct",
    "system_fingerprint": "b1-0c1e570",
    "object": "chat.completion",
    "usage": {
        "completion_tokens": 8,
        "prompt_tokens": 32,
        "total_tokens": 40,
        "prompt_tokens_details": {"cached_tokens": 0},
    },
    "id": "chatcmpl-BrvSC9mLyQtPeNcJdku1XshuvlhaFrmR",
    "timings": {
        "cache_n": 0,
        "prompt_n": 32,
        "prompt_ms": 505.917,
        "prompt_per_token_ms": 15.80990625,
        "prompt_per_second": 63.251481962456296,
        "predicted_n": 8,
        "predicted_ms": 229.846,
        "predicted_per_token_ms": 32.835142857142856,
        "predicted_per_second": 30.455174334119366,
    },
}
LLAMA_OVERFLOW = {
    "error": {
        "code": 400,
        "message": "request (2131 tokens) exceeds the available context size (2048 tokens), try increasing it",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": 2131,
        "n_ctx": 2048,
    }
}
VLLM_MODEL = {"id": "m", "object": "model", "owned_by": "vllm", "root": "m", "max_model_len": 32768}
VLLM_OVERFLOW = {
    "error": {
        "message": "This model's maximum context length is 32768 tokens. However, you requested 40000 tokens "
        "(39000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}


def test_engines_are_told_apart_by_what_they_list() -> None:
    assert engine_of(LLAMA_MODEL) == LLAMA_SERVER and context_of(LLAMA_MODEL) == 2048
    assert engine_of(VLLM_MODEL) == VLLM and context_of(VLLM_MODEL) == 32768
    ollama = {"id": "llama3.2:latest", "object": "model", "created": 1, "owned_by": "library"}
    assert engine_of(ollama) == OLLAMA and context_of(ollama) is None
    assert props_context({"default_generation_settings": {"n_ctx": 2048, "params": {}}, "total_slots": 1}) == 2048
    assert ollama_context({"parameters": 'stop "<|eot_id|>"\nnum_ctx 8192\ntemperature 0.6'}) == 8192
    assert ollama_context({"parameters": "temperature 0.6"}) is None


def test_context_errors_are_read_in_each_engines_shape() -> None:
    llama = context_overflow(400, json.dumps(LLAMA_OVERFLOW).encode())
    assert llama is not None and (llama.prompt_tokens, llama.context) == (2131, 2048)
    vllm = context_overflow(400, json.dumps(VLLM_OVERFLOW).encode())
    assert vllm is not None and (vllm.prompt_tokens, vllm.context) == (40000, 32768)
    other = {"error": {"message": "'messages' must be a non-empty array", "type": "invalid_request_error"}}
    assert context_overflow(400, json.dumps(other).encode()) is None
    assert context_overflow(500, json.dumps(LLAMA_OVERFLOW).encode()) is None
    assert context_overflow(400, b"<html>nope</html>") is None


# -- a llama-server double -------------------------------------------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class OneSlot:
    """llama-server's KV cache with ``--parallel 1`` and its host-RAM prompt cache (``--cache-ram``)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []  # the slot's prompt, then what it generated
        self.ram: list[list[int]] = []  # prompts saved to host RAM

    def take(self, prompt: list[int]) -> int:
        """Select the slot for ``prompt``; how many of its tokens are reused."""
        lcp = common_prefix(self.tokens, prompt)
        similar = lcp / len(prompt) > 0.1  # --slot-prompt-similarity 0.10, else picked as least recently used
        if self.tokens and (not similar or lcp / len(self.tokens) < 0.5):
            # About to lose most of the slot: saved to RAM, and the best kept prompt loaded instead.
            self.ram = [kept for kept in self.ram if common_prefix(kept, self.tokens) < len(kept)] + [self.tokens]
            keep, sim = lcp / len(self.tokens), lcp / len(prompt)
            for kept in self.ram:
                shared = common_prefix(kept, prompt)
                if shared / len(kept) >= 0.25 and shared / len(kept) > keep and shared / len(prompt) > sim:
                    keep, sim, self.tokens = shared / len(kept), shared / len(prompt), kept
            lcp = common_prefix(self.tokens, prompt)
        return lcp

    def finish(self, prompt: list[int], generated: list[int]) -> None:
        self.tokens = prompt + generated


def chatml(messages: list[dict[str, Any]]) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


class LlamaServerDouble:
    """What the proxy reads of llama-server, with a 2,048-token slot."""

    def __init__(self, n_ctx: int = 2048, *, lists_context: bool = True) -> None:
        self.n_ctx = n_ctx
        # False: a server whose listing says nothing of its context (the proxy learns it from a refusal).
        self.lists_context = lists_context
        self.counter = TokenCounter()
        self.prompts: list[int] = []  # prompt tokens of every chat request, refused ones included
        self.refused = 0
        self.slot = OneSlot()
        # Per answered request: (is a summary request, prompt tokens, cached tokens, the longest
        # prefix it shares with the conversation's previous turn and its reply)
        self.answered: list[tuple[bool, int, int, int]] = []
        self._previous_turn: list[int] = []
        # The messages of every answered request that is not a summary request.
        self.turns: list[list[dict[str, Any]]] = []

    def app(self) -> Starlette:
        async def models(request: Request) -> JSONResponse:
            if not self.lists_context:
                return JSONResponse({"object": "list", "data": [{"id": LLAMA_MODEL["id"], "object": "model"}]})
            model = {**LLAMA_MODEL, "meta": {**LLAMA_MODEL["meta"], "n_ctx": self.n_ctx}}
            return JSONResponse({**LLAMA_LISTING, "data": [model]})

        async def props(request: Request) -> JSONResponse:
            return JSONResponse({"default_generation_settings": {"n_ctx": self.n_ctx, "params": {}}, "total_slots": 1})

        async def health(request: Request) -> JSONResponse:
            return JSONResponse({"status": "ok"})

        async def apply_template(request: Request) -> JSONResponse:
            body = await request.json()
            text = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in body["messages"])
            return JSONResponse({"prompt": text})

        async def tokenize(request: Request) -> JSONResponse:
            body = await request.json()
            return JSONResponse({"tokens": list(range(self.counter.count_text(body["content"])))})

        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            tokens = load_encoding().encode_ordinary(chatml(body["messages"]))
            prompt = len(tokens)
            self.prompts.append(prompt)
            if prompt >= self.n_ctx:
                self.refused += 1
                error = {**LLAMA_OVERFLOW["error"], "n_prompt_tokens": prompt, "n_ctx": self.n_ctx}
                error["message"] = f"request ({prompt} tokens) exceeds the available context size ({self.n_ctx} tokens)"
                return JSONResponse({"error": error}, status_code=400)
            summarizing = "summary" in str(body["messages"][-1].get("content")).lower()
            text = "Summary: the user asked about drills, walls and tiles; the assistant answered each."
            if not summarizing:
                text = "Use a masonry bit, low speed, no hammer mode on tiles."
            completion = self.counter.count_text(text)
            cached = self.slot.take(tokens)
            generated = load_encoding().encode_ordinary(text + "<|im_end|>")
            self.slot.finish(tokens, generated)
            self.answered.append((summarizing, prompt, cached, common_prefix(self._previous_turn, tokens)))
            if not summarizing:
                self._previous_turn = tokens + generated
                self.turns.append(body["messages"])
            usage = {
                "completion_tokens": completion,
                "prompt_tokens": prompt,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            timings = {**LLAMA_ANSWER["timings"], "cache_n": cached, "prompt_n": prompt - cached}
            choice = {"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": text}}
            return JSONResponse({**LLAMA_ANSWER, "choices": [choice], "usage": usage, "timings": timings})

        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/props", props),
                Route("/health", health),
                Route("/apply-template", apply_template, methods=["POST"]),
                Route("/tokenize", tokenize, methods=["POST"]),
                Route("/v1/chat/completions", chat, methods=["POST"]),
            ]
        )


@pytest.fixture(params=[True, False], ids=["context listed", "context unsaid"])
def llama(request: pytest.FixtureRequest) -> Iterator[tuple[LlamaServerDouble, LiveServer]]:
    double = LlamaServerDouble(lists_context=request.param)
    server = LiveServer(double.app()).start()
    yield double, server
    server.stop()


def test_the_proxy_learns_a_llama_servers_slot_context_and_says_so(llama: tuple[LlamaServerDouble, LiveServer]) -> None:
    double, server = llama
    if not double.lists_context:
        pytest.skip("a listing that says nothing of the context")
    proxy = LiveServer(create_app(Settings(upstream=server.url + "/v1"))).start()
    try:
        ready = httpx.get(proxy.url + "/readyz").json()
    finally:
        proxy.stop()
    assert list(ready["engines"].values()) == [{"engine": LLAMA_SERVER, "context": 2048}]


def test_tenants_on_an_engine_without_a_cache_salt_are_told_they_share_its_cache(
    llama: tuple[LlamaServerDouble, LiveServer],
) -> None:
    """llama-server takes no ``cache_salt``: with tenants isolated, /readyz says its cache is shared
    (and the start-up log), instead of promising an isolation the engine does not give."""
    double, server = llama
    if not double.lists_context:
        pytest.skip("one listing is enough")
    tenants = [{"name": "a", "api_key": "sk-a"}, {"name": "b", "api_key": "sk-b"}]
    for isolation, shared in ((True, True), (False, False)):
        settings = Settings(upstream=server.url + "/v1", tenants=tenants, tenant_cache_isolation=isolation)
        proxy = LiveServer(create_app(settings)).start()
        try:
            response = httpx.get(proxy.url + "/readyz")
        finally:
            proxy.stop()
        assert response.status_code == 200
        assert response.json()["status"] == "ready"
        warnings = response.json().get("warnings", [])
        assert any("takes no cache_salt" in line for line in warnings) is shared, warnings
    open_proxy = LiveServer(create_app(Settings(upstream=server.url + "/v1"))).start()
    try:
        assert "warnings" not in httpx.get(open_proxy.url + "/readyz").json()
    finally:
        open_proxy.stop()


def test_a_chat_past_a_small_context_is_answered_every_turn(llama: tuple[LlamaServerDouble, LiveServer]) -> None:
    """16 turns whose history outgrows a 2,048-token slot: direct, llama-server refuses the later
    turns; through the proxy on its defaults, every turn is answered: compacted before the context's
    end where the listing says it, and where it does not, compacted and sent again on the refusal."""
    double, server = llama
    question = "How do I drill into a brick wall without cracking it, and which bit and speed should I use? "
    answer = "Use a masonry bit at low speed, mark the spot with tape, and keep the drill level. " * 6

    def conversation(url: str, session: str) -> list[int]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a hardware store assistant."}]
        statuses = []
        for turn in range(16):
            messages.append({"role": "user", "content": f"Turn {turn}. " + question * 3})
            response = httpx.post(
                url + "/v1/chat/completions",
                json={"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 64},
                headers={"x-session-id": session},
                timeout=60,
            )
            statuses.append(response.status_code)
            messages.append({"role": "assistant", "content": answer})
        return statuses

    direct = conversation(server.url, "direct")
    assert 400 in direct  # the engine's own refusal: the history outgrew its context
    double.refused = 0
    proxy = LiveServer(create_app(Settings(upstream=server.url + "/v1"))).start()
    try:
        proxied = conversation(proxy.url, "proxied")
    finally:
        proxy.stop()
    assert proxied == [200] * 16, proxied


def test_a_summary_request_keeps_the_conversation_in_a_single_slot() -> None:
    """llama-server with one slot: the proxy's summary request extends the conversation the slot
    holds (the whole of it, then the instruction) instead of replacing it, so the turn after it
    reuses everything the previous turn sent and got; only the turn that first carries the summary
    computes its kept turns again. Every turn answered, and the prefill per turn stated."""
    double = LlamaServerDouble()
    server = LiveServer(double.app()).start()
    proxy = LiveServer(create_app(Settings(upstream=server.url + "/v1"))).start()
    question = "How do I drill into a brick wall without cracking it, and which bit and speed should I use? "
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a hardware store assistant."}]
    try:
        for turn in range(16):
            messages.append({"role": "user", "content": f"Turn {turn}. " + question * 6})
            response = httpx.post(
                proxy.url + "/v1/chat/completions",
                json={"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 64},
                headers={"x-session-id": "one-slot"},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            messages.append(response.json()["choices"][0]["message"])
    finally:
        proxy.stop()
        server.stop()
    summaries = [index for index, (summarizing, *_) in enumerate(double.answered) if summarizing]
    assert summaries, "the history outgrew the slot: a summary was made"
    for index in summaries:
        if index + 1 < len(double.answered):
            _, _, cached, shared = double.answered[index + 1]
            assert cached >= shared, "the summary request evicted the conversation from the slot"
    turns = [(prompt, cached) for summarizing, prompt, cached, _ in double.answered if not summarizing]
    assert len(turns) == 16
    # The summary is computed a few requests ahead of the one that first carries it (lookahead): the
    # turns it leaves verbatim are counted where it is read, so that request follows it with
    # keep_last_turns whole exchanges and its own question, not those plus every turn that came
    # meanwhile (which left it past the soft threshold at once, for another summary and another
    # recompute of the kept turns a few requests later).
    carrying = [messages for messages in double.turns if any(is_summary_message(m) for m in messages)]
    assert carrying, "a turn carried the summary"
    first = carrying[0]
    after = next(i for i, m in enumerate(first) if is_summary_message(m))
    keep = Settings().summarizer.keep_last_turns
    assert sum(1 for m in first[after:] if m["role"] == "user") == keep + 1


def test_a_summary_computed_ahead_leaves_verbatim_what_the_policy_says_where_it_is_used() -> None:
    """A conversation at 1,542 of a 1,952-token budget, growing 141 tokens a request, reaches it in 3
    requests: the summary computed now leaves out 2 turns, and 2 more come before it is used."""
    assert requests_until_used(1542, 96, 1401, 1952) == 3
    assert requests_until_used(1900, 96, 1750, 1952) == 1  # the next request carries it
    assert requests_until_used(300, 20, 0, 1952) is None  # growth unknown: the session's first
    assert [kept_when_used(4, n) for n in (None, 1, 2, 3, 4, 9)] == [4, 4, 3, 2, 1, 1]
    assert kept_when_used(0, 3) == 0
