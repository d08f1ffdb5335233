"""The proxy in front of engines it has no family for: doubles answering as each engine's code does
(an engines review: each test failed before its fix).

- vLLM before 0.10.1 (PR 22099) writes its errors flat: {"object": "error", "message", "type",
  "param", "code"}, no "error" wrapper; 0.9-0.10 on engine V0 refuse ``cache_salt`` with 400
  (protocol.py ``check_cache_salt_support``); without --enable-prompt-tokens-details no
  ``prompt_tokens_details`` at all.
- SGLang: /v1/models lists ``owned_by: "sglang"`` and ``max_model_len``; errors flat
  (serving_base.create_error_response: ErrorResponse(object="error", message, type, param, code));
  the context errors of tokenizer_manager._validate_one_request: "The input (N tokens) is longer
  than the model's context length (M tokens)." and "Requested token count exceeds the model's
  maximum context length of M tokens. ..."; ``cached_tokens`` only with --enable-cache-report.
- TGI (router/src): /v1/models ``owned_by`` = the model id, no context (that is /info's
  max_total_tokens); validation errors 422 {"error": "Input validation error: `inputs` tokens +
  `max_new_tokens` must be <= N. Given: P `inputs` tokens and K `max_new_tokens`",
  "error_type": "validation"}; usage without prompt_tokens_details.
"""

from __future__ import annotations

import asyncio
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
from proxy.backends import Backend, BackendPool, ModelCatalog, RoundRobin, Upstream
from proxy.backends.engines import GENERIC, VLLM, ContextOverflow, context_overflow
from proxy.config import Settings
from proxy.tokenization import load_encoding
from tests.helpers import LiveServer

MODEL = "m"


def chatml(messages: list[dict[str, Any]]) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


def vllm_flat(message: str) -> tuple[int, dict[str, Any]]:
    return 400, {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}


def vllm_nested(message: str) -> tuple[int, dict[str, Any]]:
    return 400, {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}


class EngineDouble:
    """One model, a context of ``n_ctx``; refuses prompt + max_tokens past it (vLLM, SGLang, TGI all do)."""

    def __init__(
        self, flavour: str, n_ctx: int = 2048, *, cache_report: bool = True, salt_v0: str = "", strict: bool = False
    ) -> None:
        self.flavour, self.n_ctx, self.cache_report, self.salt_v0 = flavour, n_ctx, cache_report, salt_v0
        # A strict chat template (Mistral's, Gemma's): a system message after the first message raises.
        self.strict = strict
        self.refused = 0
        self.bodies: list[dict[str, Any]] = []
        self.last: list[int] = []

    def listing(self) -> dict[str, Any]:
        if self.flavour == "tgi":
            return {"id": MODEL, "object": "model", "created": 0, "owned_by": MODEL}
        owner = "sglang" if self.flavour.startswith("sglang") else "vllm"
        return {"id": MODEL, "object": "model", "owned_by": owner, "root": MODEL, "max_model_len": self.n_ctx}

    def overflow(self, prompt: int, max_new: int) -> tuple[int, dict[str, Any]]:
        total = prompt + max_new
        if self.flavour == "tgi":
            message = (
                f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {self.n_ctx}. "
                f"Given: {prompt} `inputs` tokens and {max_new} `max_new_tokens`"
            )
            return 422, {"error": message, "error_type": "validation"}
        if self.flavour == "sglang-input" or (self.flavour == "sglang" and prompt >= self.n_ctx):
            message = f"The input ({prompt} tokens) is longer than the model's context length ({self.n_ctx} tokens)."
            return 400, {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
        if self.flavour == "sglang":
            message = (
                f"Requested token count exceeds the model's maximum context length of {self.n_ctx} tokens. "
                f"You requested a total of {total} tokens: {prompt} tokens from the input messages and "
                f"{max_new} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )
            return 400, {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
        message = (
            f"This model's maximum context length is {self.n_ctx} tokens. However, you requested {total} tokens "
            f"({prompt} in the messages, {max_new} in the completion). Please reduce the length of the messages "
            "or completion."
        )
        return (vllm_flat if self.flavour == "vllm-0.8" else vllm_nested)(message)

    def app(self) -> Starlette:
        async def models(_: Request) -> JSONResponse:
            return JSONResponse({"object": "list", "data": [self.listing()]})

        async def chat(request: Request) -> JSONResponse:
            body = json.loads(await request.body())
            self.bodies.append(body)
            if self.salt_v0 and body.get("cache_salt") is not None:
                if self.salt_v0 == "0.6":  # OpenAIBaseModel extra="forbid" until PR 10463 (v0.6.5)
                    why = "cache_salt\n  Extra inputs are not permitted [type=extra_forbidden]"
                else:  # 0.9-0.10, engine V0: check_cache_salt_support
                    why = (
                        "Value error, Parameter 'cache_salt' is not supported with this instance of vLLM, "
                        "which uses engine V0."
                    )
                status, error = vllm_flat("1 validation error for ChatCompletionRequest\n" + why)
                return JSONResponse(error, status_code=status)
            if "seed" in body and not isinstance(body["seed"], int):
                # pydantic quotes the input it could not read (vLLM's request models).
                message = (
                    "1 validation error for ChatCompletionRequest\nseed\n  Input should be a valid integer, "
                    f"unable to parse string as an integer [type=int_parsing, input_value={body['seed']!r}, "
                    "input_type=str]"
                )
                return JSONResponse(vllm_nested(message)[1], status_code=400)
            if self.strict and any(m.get("role") == "system" for m in body["messages"][1:]):
                # TGI: raise_exception in the template -> InferError::TemplateError -> 422; vLLM: 400.
                message = (
                    "Template error: invalid operation: Conversation roles must alternate "
                    "user/assistant/user/assistant/..."
                )
                if self.flavour == "tgi":
                    return JSONResponse({"error": message, "error_type": "template_error"}, status_code=422)
                return JSONResponse(vllm_nested(message)[1], status_code=400)
            tokens = load_encoding().encode_ordinary(chatml(body["messages"]))
            prompt = len(tokens)
            max_new = body.get("max_completion_tokens") or body.get("max_tokens") or 0
            if prompt >= self.n_ctx or prompt + max_new > self.n_ctx:
                self.refused += 1
                status, error = self.overflow(prompt, max_new)
                return JSONResponse(error, status_code=status)
            cached = 0
            for a, b in zip(self.last, tokens, strict=False):
                if a != b:
                    break
                cached += 1
            cached -= cached % 16
            self.last = tokens
            usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": 8, "total_tokens": prompt + 8}
            if self.cache_report:
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            text = (
                "Summary: drills, walls, tiles."
                if "summar" in str(body["messages"][-1]).lower()
                else "Use a masonry bit."
            )
            return JSONResponse(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "model": MODEL,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                    ],
                    "usage": usage,
                }
            )

        async def info(_: Request) -> JSONResponse:
            # TGI's /info (router/src/server.rs): the limits it validates requests against.
            if self.flavour != "tgi":
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse({"model_id": MODEL, "max_input_tokens": self.n_ctx - 1, "max_total_tokens": self.n_ctx})

        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/info", info),
            ]
        )


def _serve(double: EngineDouble, **settings: Any) -> Iterator[tuple[LiveServer, EngineDouble]]:
    upstream = LiveServer(double.app()).start()
    proxy = LiveServer(create_app(Settings(upstream=upstream.url + "/v1", **settings))).start()
    try:
        yield proxy, double
    finally:
        proxy.stop()
        upstream.stop()


# -- 1. context errors the proxy does not read as such: no compact-and-retry ---------------------


@pytest.mark.parametrize("flavour", ["vllm-0.11", "vllm-0.8", "sglang", "tgi"])
def test_an_engines_context_refusal_is_compacted_and_sent_again(flavour: str) -> None:
    """A conversation whose prompt plus max_tokens passes the engine's context. vLLM >= 0.10.1 (the
    control): the refusal is read, the turn compacted and sent again, 200. The same refusal in vLLM
    0.6-0.10.0's and SGLang's flat shape, SGLang's own words, or TGI's 422: passed to the client."""
    double = EngineDouble(flavour)
    for proxy, _ in _serve(double):
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a hardware store assistant."}]
        for turn in range(6):
            messages.append({"role": "user", "content": f"Turn {turn}. How do I drill a brick wall? " * 10})
            messages.append({"role": "assistant", "content": "Use a masonry bit at low speed. " * 12})
        messages.append({"role": "user", "content": "And tiles?"})
        body = {"model": MODEL, "messages": messages, "max_tokens": 900}
        answer = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": "s1"}, timeout=60)
        assert double.refused >= 1  # the engine did refuse it: the scenario reached its context
        assert answer.status_code == 200, (flavour, answer.status_code, answer.text[:300])


def test_context_errors_in_the_shapes_other_engines_write() -> None:
    for flavour in ("vllm-0.8", "sglang", "sglang-input", "tgi"):
        status, body = EngineDouble(flavour).overflow(2100, 900)
        assert context_overflow(status, json.dumps(body).encode()) is not None, flavour


# -- 2. cache_salt forwarded to an engine that refuses it ---------------------------------------


@pytest.mark.parametrize("release", ["0.6", "0.9-v0"])
def test_tenants_in_front_of_a_vllm_v0_engine_are_answered(release: str) -> None:
    """vLLM 0.9-0.10 on engine V0 refuses any request carrying cache_salt: with tenants configured
    (isolation on by default) every chat request is a 400 the engine would not give the client."""
    tenants = [{"name": "a", "api_key": "sk-a"}]
    for proxy, _double in _serve(EngineDouble("vllm-0.8", salt_v0=release), tenants=tenants):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        answer = httpx.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-a"}, timeout=20
        )
        assert answer.status_code == 200, answer.text[:300]


# -- 3. an engine that does not report cached tokens: every turn a "cache_evicted" break -------


def test_an_engine_that_reports_no_cached_tokens_shows_no_evictions() -> None:
    """TGI, Ollama, SGLang without --enable-cache-report, vLLM without
    --enable-prompt-tokens-details: usage has no prompt_tokens_details. Nothing was evicted; the
    proxy cannot tell, and should say nothing (not ``cache_evicted``, not the eviction alert's counter)."""
    for proxy, _ in _serve(EngineDouble("vllm-0.11", n_ctx=32768, cache_report=False)):
        system = {"role": "system", "content": "You are a careful assistant for a hardware store. " * 80}
        messages: list[dict[str, Any]] = [system, {"role": "user", "content": "How do I drill brick?"}]
        headers = {"x-session-id": "s1"}
        first = httpx.post(
            proxy.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages}, headers=headers
        )
        assert first.status_code == 200
        messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "And tiles?"}]
        second = httpx.post(
            proxy.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages}, headers=headers
        )
        assert second.status_code == 200
        metrics = httpx.get(proxy.url + "/metrics").text
        evicted = [
            line
            for line in metrics.splitlines()
            if line.startswith("prefix_proxy_cache_breaks_total") and "cache_evicted" in line
        ]
        assert not second.headers.get("x-prefix-proxy-cache-break", "none").startswith("cache_evicted"), (
            second.headers.get("x-prefix-proxy-cache-break")
        )
        assert all(line.endswith(" 0.0") for line in evicted), evicted


def test_the_control_an_engine_that_reports_them_shows_no_eviction() -> None:
    for proxy, _ in _serve(EngineDouble("vllm-0.11", n_ctx=32768, cache_report=True)):
        system = {"role": "system", "content": "You are a careful assistant for a hardware store. " * 80}
        messages: list[dict[str, Any]] = [system, {"role": "user", "content": "How do I drill brick?"}]
        headers = {"x-session-id": "s1"}
        first = httpx.post(
            proxy.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages}, headers=headers
        )
        messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "And tiles?"}]
        second = httpx.post(
            proxy.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages}, headers=headers
        )
        assert second.headers.get("x-prefix-proxy-cache-break") == "none", second.headers.get(
            "x-prefix-proxy-cache-break"
        )


# -- 4. the context of an engine that lists none -------------------------------------------------


def test_the_proxy_knows_a_tgi_context() -> None:
    """TGI lists no context at /v1/models; its /info says max_total_tokens: the proxy reads it there
    (it had none, and so never compacted before TGI's context)."""
    for proxy, _ in _serve(EngineDouble("tgi")):
        engines = httpx.get(proxy.url + "/readyz").json()["engines"]
        assert [e.get("context") for e in engines.values()] == [2048], engines


# -- 5. TGI's errors: its 422s are neither read (template refusal) nor relayed (message dropped) ---


@pytest.mark.parametrize("flavour", ["vllm-0.11", "tgi"])
def test_a_strict_template_refusal_is_retried_in_the_clients_order(flavour: str) -> None:
    """The proxy moves a volatile date line into a system message of its own; a strict template
    refuses it. vLLM (400, the control): retried keeping the client's order, 200. TGI answers the
    same refusal 422 (InferError::TemplateError): passed to the client, on every request."""
    for proxy, double in _serve(EngineDouble(flavour, n_ctx=32768, strict=True)):
        statuses = []
        for day in ("Monday, September 8", "Tuesday, September 9", "Wednesday, September 10"):
            system = {"role": "system", "content": f"Current date: {day}, 2025.\nYou are a helpful assistant."}
            messages = [system, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
            body = {
                "model": MODEL,
                "messages": [*messages, {"role": "user", "content": "What day is it?"}],
                "max_tokens": 8,
            }
            statuses.append(httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=20).status_code)
        moved = [b for b in double.bodies if any(m.get("role") == "system" for m in b["messages"][1:])]
        assert moved  # the proxy did move the line (the date changed between requests)
        assert statuses == [200, 200, 200], (flavour, statuses)


def test_tgis_error_message_reaches_the_client() -> None:
    """TGI writes {"error": "<message>", "error_type": ...}: the client gets "upstream returned HTTP 422"."""
    for proxy, _ in _serve(EngineDouble("tgi")):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 3000}], "max_tokens": 8}
        answer = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=20)
        assert answer.status_code == 422
        assert "must be <= 2048" in answer.json()["error"]["message"], answer.text[:300]


# -- 6. llama-server builds whose /v1/models meta has no n_ctx (before it was added) ----------------


def test_a_llama_server_context_is_read_from_props_when_the_listing_lacks_it() -> None:
    """model_meta() of older llama-server builds (and llamafile's) lists vocab_type, n_vocab,
    n_ctx_train, n_embd, n_params, size: no n_ctx. /props says default_generation_settings.n_ctx;
    engines.props_context reads it, and nothing calls it."""
    meta = {"vocab_type": 2, "n_vocab": 49152, "n_ctx_train": 8192, "n_embd": 576, "n_params": 1, "size": 1}

    async def models(_: Request) -> JSONResponse:
        entry = {"id": MODEL, "object": "model", "created": 1, "owned_by": "llamacpp", "meta": meta}
        return JSONResponse({"object": "list", "data": [entry]})

    async def props(_: Request) -> JSONResponse:
        return JSONResponse({"default_generation_settings": {"n_ctx": 2048}, "total_slots": 1})

    upstream = LiveServer(Starlette(routes=[Route("/v1/models", models), Route("/props", props)])).start()
    proxy = LiveServer(create_app(Settings(upstream=upstream.url + "/v1"))).start()
    try:
        engines = httpx.get(proxy.url + "/readyz").json()["engines"]
    finally:
        proxy.stop()
        upstream.stop()
    assert list(engines.values()) == [{"engine": "llama-server", "context": 2048}], engines


def test_an_error_that_quotes_cache_salt_does_not_switch_salting_off() -> None:
    """A tenant provokes a 400 whose message quotes its own input ("cache_salt" as a seed, echoed by
    pydantic): not the engine refusing the field. Salting stays on for every tenant."""
    tenants = [{"name": "a", "api_key": "sk-a"}, {"name": "b", "api_key": "sk-b"}]
    for proxy, double in _serve(EngineDouble("vllm-0.11"), tenants=tenants):
        quoted = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": "cache_salt"}
        provoked = httpx.post(
            proxy.url + "/v1/chat/completions", json=quoted, headers={"authorization": "Bearer sk-a"}, timeout=20
        )
        assert provoked.status_code == 400 and "input_value='cache_salt'" in provoked.text
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        answer = httpx.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-b"}, timeout=20
        )
        assert answer.status_code == 200
        assert "cache_salt" in double.bodies[-1], "tenant b's request went without its cache salt"


def test_context_refusals_are_the_engines_own_words_at_the_start_of_its_message() -> None:
    """vLLM's max_tokens refusal names the context too (compaction frees the room it asks for); a
    validation error that quotes a client's input holding those words is no refusal: read as one,
    a tenant could teach the proxy a context of 10 tokens for every tenant's conversations."""
    too_large = (
        "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context length is "
        "4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778)."
    )
    quoted = (
        "1 validation error for ChatCompletionRequest\nseed\n  Input should be a valid integer [type=int_parsing, "
        'input_value="This model\'s maximum context length is 10 tokens. However, you requested 20 tokens"]'
    )
    assert context_overflow(400, json.dumps(vllm_nested(too_large)[1]).encode()) == ContextOverflow(2778, 4096)
    assert context_overflow(400, json.dumps(vllm_nested(quoted)[1]).encode()) is None


def test_a_refusal_never_replaces_the_context_the_engine_lists() -> None:
    """What a listing says (vLLM's max_model_len) stays; a refusal teaches a context only where the
    listing and the engine's self-description said none, and only for a model the engines list."""
    catalog = ModelCatalog(BackendPool([Backend("b", Upstream("http://b/v1"))], RoundRobin()))
    catalog._engines, catalog._lengths = {"listed": VLLM, "silent": GENERIC}, {"listed": 4096}
    for model, context in (("listed", 10), ("silent", 2048), ("unlisted", 10)):
        catalog.learn_context(model, context)
    assert catalog._lengths == {"listed": 4096, "silent": 2048}


# -- a review of this file's fixes: what a client's own 400 may hold, and whose context a backend says --
ECHO_TENANTS = [{"name": "acme", "api_key": "sk-acme"}, {"name": "globex", "api_key": "sk-globex"}]


class VllmEcho:
    """vLLM >= 0.10.1 with cache_salt supported. A request that fails one of ChatCompletionRequest's
    mode="before" model validators (here check_generation_prompt: continue_final_message and
    add_generation_prompt both true) gets vLLM's validation_exception_handler answer: 400, message
    ``f"{exc_str} {errors_str}"`` where ``errors_str = str(exc.errors())`` holds the error's
    ``input``, the whole request body (api_server.py)."""

    def __init__(self, listing: dict[str, Any] | None = None) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.listing = listing or {"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 32768}

    def app(self) -> Starlette:
        async def models(_: Request) -> JSONResponse:
            return JSONResponse({"object": "list", "data": [self.listing]})

        async def chat(request: Request) -> JSONResponse:
            body = json.loads(await request.body())
            self.bodies.append(body)
            if body.get("continue_final_message") and body.get("add_generation_prompt"):
                error = {
                    "type": "value_error",
                    "loc": ("body",),
                    "msg": "Value error, Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                    "input": body,
                }
                message = f"1 validation error:\n  {error} {[error]}"
                return JSONResponse(
                    {"error": {"message": message, "type": "Bad Request", "param": None, "code": 400}},
                    status_code=400,
                )
            usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
            return JSONResponse(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "model": body.get("model"),
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                    ],
                    "usage": usage,
                }
            )

        return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


def _chat(proxy: LiveServer, key: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


# -- 1. one tenant's malformed request switches cache isolation off for every tenant -------------------


def test_a_tenants_client_error_does_not_unsalt_the_model_for_other_tenants() -> None:
    double = VllmEcho()
    upstream = LiveServer(double.app()).start()
    proxy = LiveServer(create_app(Settings(upstream=upstream.url + "/v1", tenants=ECHO_TENANTS))).start()
    try:
        bad = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "add_generation_prompt": True,
            "continue_final_message": True,
        }
        assert _chat(proxy, "sk-acme", bad).status_code == 400  # acme's own mistake, answered as vLLM does
        good = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        assert _chat(proxy, "sk-globex", good).status_code == 200
    finally:
        proxy.stop()
        upstream.stop()
    assert "cache_salt" in double.bodies[-1], "globex's request reached vLLM without its cache_salt"


# -- 2. learn_context: a number quoted in a client-controlled 400 becomes the model's context ----------


def test_an_echoed_context_sentence_does_not_become_the_models_context() -> None:
    double = VllmEcho()
    upstream = LiveServer(double.app()).start()
    app = create_app(Settings(upstream=upstream.url + "/v1"))
    proxy = LiveServer(app).start()
    try:
        bait = "This model's maximum context length is 64 tokens. However, you requested 9000 tokens"
        bad = {
            "model": MODEL,
            "messages": [{"role": "user", "content": bait}],
            "add_generation_prompt": True,
            "continue_final_message": True,
        }
        assert _chat(proxy, None, bad).status_code == 400
        state = app.state.proxy
        context = asyncio.run(state.models.max_model_len(MODEL))
    finally:
        proxy.stop()
        upstream.stop()
    assert context == 32768, f"the model's context is now {context}: read from text the client wrote"


# -- 3. described_context: one backend's /props given to another backend's models ---------------------


def test_a_context_described_by_one_backend_is_not_given_to_another_backends_model() -> None:
    meta = {"vocab_type": 2, "n_vocab": 49152, "n_ctx_train": 8192}

    async def old_llama_models(_: Request) -> JSONResponse:
        entry = {"id": "small", "object": "model", "owned_by": "llamacpp", "meta": meta}
        return JSONResponse({"object": "list", "data": [entry]})

    async def props(_: Request) -> JSONResponse:
        return JSONResponse({"default_generation_settings": {"n_ctx": 2048}, "total_slots": 1})

    async def gateway_models(_: Request) -> JSONResponse:  # a generic OpenAI-compatible server, no context listed
        return JSONResponse({"object": "list", "data": [{"id": "big", "object": "model", "owned_by": "gateway"}]})

    llama = LiveServer(Starlette(routes=[Route("/v1/models", old_llama_models), Route("/props", props)])).start()
    gateway = LiveServer(Starlette(routes=[Route("/v1/models", gateway_models)])).start()
    app = create_app(Settings(upstreams=[llama.url + "/v1", gateway.url + "/v1"]))
    try:
        contexts = asyncio.run(_contexts(app, ["small", "big"]))
    finally:
        llama.stop()
        gateway.stop()
    assert contexts["small"] == 2048
    assert contexts["big"] is None, f"'big' (on another backend, which said nothing) got {contexts['big']}"


async def _contexts(app: Any, models: list[str]) -> dict[str, int | None]:
    state = app.state.proxy
    return {model: await state.models.max_model_len(model) for model in models}


def test_readyz_does_not_wait_on_an_upstreams_props_route() -> None:
    """A generic OpenAI-compatible upstream (a gateway) lists models without a context; its root
    routes are another service's and answer slowly. /readyz asked only /v1/models before."""
    import time

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "gpt", "object": "model", "owned_by": "gateway"}]})

    async def slow(_: Request) -> JSONResponse:
        await asyncio.sleep(2.5)
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    gateway = LiveServer(
        Starlette(routes=[Route("/v1/models", models), Route("/props", slow), Route("/info", slow)])
    ).start()
    proxy = LiveServer(create_app(Settings(upstream=gateway.url + "/v1"))).start()
    try:
        started = time.monotonic()
        answer = httpx.get(proxy.url + "/readyz", timeout=30)
        took = time.monotonic() - started
    finally:
        proxy.stop()
        gateway.stop()
    assert answer.status_code == 200
    assert took < 3.0, f"/readyz took {took:.1f} s (the chart's readinessProbe timeoutSeconds is 3)"
