"""Fields of a request the engine reads that the proxy read otherwise (found by a review): text in
content parts other than ``text``, a completion limit the engine ignores, a response id a tenant
chose, and deployment fields on the pooling routes. Each test fails without its fix."""

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
from proxy.config import Settings
from proxy.openai import message_text
from proxy.openai.messages import part_text
from tests.helpers import LiveServer

MODEL = "m"


class Capture:
    def __init__(self, owner: str = "vllm", max_model_len: int | None = 4096, listed: str = MODEL) -> None:
        self.owner, self.len, self.listed = owner, max_model_len, listed
        self.bodies: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.responses: dict[str, list] = {}

    def app(self) -> Starlette:
        async def models(_: Request) -> JSONResponse:
            entry: dict[str, Any] = {"id": self.listed, "object": "model", "owned_by": self.owner}
            if self.len:
                entry["max_model_len"] = self.len
            return JSONResponse({"object": "list", "data": [entry]})

        async def chat(request: Request) -> JSONResponse:
            body = json.loads(await request.body())
            self.bodies.append((request.url.path, body, dict(request.headers)))
            return JSONResponse(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "model": MODEL,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                    ],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
                }
            )

        async def responses(request: Request) -> JSONResponse:
            body = json.loads(await request.body())
            self.bodies.append((request.url.path, body, dict(request.headers)))
            # vLLM: ResponsesResponse.id is request.request_id (client-settable), stored under it.
            rid = body.get("request_id") or f"resp_{len(self.bodies)}"
            self.responses[rid] = body["input"]
            return JSONResponse(
                {
                    "id": rid,
                    "object": "response",
                    "status": "completed",
                    "model": MODEL,
                    "output": [
                        {
                            "type": "message",
                            "role": "assistant",
                            "id": "m1",
                            "status": "completed",
                            "content": [{"type": "output_text", "text": "ok", "annotations": []}],
                        }
                    ],
                    "usage": {
                        "input_tokens": 5,
                        "output_tokens": 1,
                        "total_tokens": 6,
                        "input_tokens_details": {"cached_tokens": 0},
                    },
                }
            )

        async def get_response(request: Request) -> JSONResponse:
            rid = request.path_params["rid"]
            return JSONResponse({"id": rid, "input": self.responses.get(rid)})

        async def passthrough(request: Request) -> JSONResponse:
            body = json.loads(await request.body())
            self.bodies.append((request.url.path, body, dict(request.headers)))
            return JSONResponse({"object": "list", "data": [], "usage": {"prompt_tokens": 1, "total_tokens": 1}})

        async def completion(request: Request) -> JSONResponse:
            self.bodies.append((request.url.path, json.loads(await request.body()), dict(request.headers)))
            return JSONResponse(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }
            )

        async def show(_: Request) -> JSONResponse:
            return JSONResponse({})

        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/responses", responses, methods=["POST"]),
                Route("/v1/responses/{rid}", get_response, methods=["GET"]),
                Route("/v1/completions", completion, methods=["POST"]),
                Route("/v1/embeddings", passthrough, methods=["POST"]),
                Route("/pooling", passthrough, methods=["POST"]),
                Route("/api/show", show, methods=["POST"]),
            ]
        )


def _proxy(capture: Capture, **settings: Any) -> Iterator[tuple[LiveServer, Capture]]:
    upstream = LiveServer(capture.app()).start()
    proxy = LiveServer(create_app(Settings(upstream=upstream.url + "/v1", **settings))).start()
    try:
        yield proxy, capture
    finally:
        proxy.stop()
        upstream.stop()


BUDGET = {"tenant_tokens_per_window": 3000, "window_s": 3600}
TENANTS = [{"name": "a", "api_key": "sk-a", "budget": BUDGET}, {"name": "b", "api_key": "sk-b", "budget": BUDGET}]


@pytest.fixture
def vllm() -> Iterator[tuple[LiveServer, Capture]]:
    yield from _proxy(Capture("vllm"), tenants=TENANTS)


@pytest.fixture
def ollama() -> Iterator[tuple[LiveServer, Capture]]:
    yield from _proxy(Capture("library", None), tenants=TENANTS)


def _post(server: LiveServer, path: str, body: dict[str, Any], key: str = "sk-a", **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"authorization": f"Bearer {key}", **headers}, timeout=20)


def test_refusal_and_thinking_parts_count_toward_the_prompt(vllm: tuple[LiveServer, Capture]) -> None:
    proxy, upstream = vllm
    big = "word " * 6000  # 30 KB: at least ~6000 tokens whatever the tokenizer; the budget is 3000
    as_text = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": big}]}],
    }
    assert _post(proxy, "/v1/chat/completions", as_text).status_code == 429  # control: refused
    for part in ({"type": "refusal", "refusal": big}, {"type": "thinking", "thinking": big}):
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [part]}]}
        answer = _post(proxy, "/v1/chat/completions", body)
        # vLLM renders both as text (chat_utils' MM_PARSER_MAP): the same prompt as the control.
        assert answer.status_code == 429, (part["type"], answer.status_code)
    reasoning = {"role": "assistant", "content": "ok", "reasoning_content": big}
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}, reasoning, {"role": "user", "content": "and?"}],
    }
    assert _post(proxy, "/v1/chat/completions", body).status_code == 429
    assert upstream.bodies == []


def test_part_text_reads_the_key_the_type_names() -> None:
    assert part_text({"type": "text", "text": "a"}) == "a"
    assert part_text({"type": "refusal", "refusal": "b"}) == "b"
    assert part_text({"type": "image_url", "image_url": {"url": "http://x/y.png"}}) is None
    assert part_text({"type": "type"}) is None
    assert message_text({"role": "assistant", "content": "x", "reasoning": "y"}) == "x\ny"


def test_ollama_ignores_max_completion_tokens(ollama: tuple[LiveServer, Capture]) -> None:
    proxy, _ = ollama
    msgs = [{"role": "user", "content": "hi"}]
    unbounded = _post(proxy, "/v1/chat/completions", {"model": MODEL, "messages": msgs})
    assert unbounded.status_code == 429  # control: no limit = to the end of num_ctx (4096) > 3000
    # Ollama's OpenAI API reads max_tokens alone: to it this request is as unbounded as the first.
    capped = _post(proxy, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_completion_tokens": 1})
    assert capped.status_code == 429, capped.text
    limited = _post(proxy, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1})
    assert limited.status_code == 200, limited.text


def test_a_tenant_cannot_choose_a_responses_id(vllm: tuple[LiveServer, Capture]) -> None:
    proxy, upstream = vllm
    a = _post(proxy, "/v1/responses", {"model": MODEL, "input": "secret plan", "store": True, "max_output_tokens": 8})
    victim = a.json()["id"]
    b = _post(
        proxy,
        "/v1/responses",
        {"model": MODEL, "input": "INJECTED", "store": True, "max_output_tokens": 8, "request_id": victim},
        key="sk-b",
    )
    assert b.status_code == 200
    # vLLM stores a response under the body's request_id: the tenant's never reaches it.
    assert "request_id" not in upstream.bodies[-1][1]
    assert upstream.responses[victim] == "secret plan"
    assert b.json()["id"] != victim
    retrieved = httpx.get(proxy.url + f"/v1/responses/{victim}", headers={"authorization": "Bearer sk-b"}, timeout=20)
    assert retrieved.status_code == 404


def test_a_tenants_request_id_header_is_not_the_engines(vllm: tuple[LiveServer, Capture]) -> None:
    proxy, upstream = vllm
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    answer = _post(proxy, "/v1/chat/completions", body, **{"x-request-id": "mine-1"})
    assert answer.status_code == 200
    assert answer.headers["x-request-id"] == "mine-1"  # the client's, answered back
    # vLLM names the engine request by this header: one tenant's must not collide with another's.
    assert upstream.bodies[-1][2]["x-request-id"] != "mine-1"


def test_an_open_proxy_passes_the_request_id_on() -> None:
    capture = Capture("vllm")
    for proxy, upstream in _proxy(capture):
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "request_id": "r1"}
        answer = httpx.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"x-request-id": "mine-2"}, timeout=20
        )
        assert answer.status_code == 200
        _, sent, headers = upstream.bodies[-1]
        assert headers["x-request-id"] == "mine-2" and sent["request_id"] == "r1"


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_deployment_fields_dropped_on_pooling_routes(vllm: tuple[LiveServer, Capture], path: str) -> None:
    proxy, upstream = vllm
    body = {"model": MODEL, "input": "x", "priority": -100, "kv_transfer_params": {"remote_host": "10.0.0.9"}}
    assert _post(proxy, path, body).status_code == 200
    sent = upstream.bodies[-1][1]
    assert "priority" not in sent and "kv_transfer_params" not in sent, sent
    assert sent["input"] == "x"


def test_prompt_embeds_count_toward_the_prompt(vllm: tuple[LiveServer, Capture]) -> None:
    """vLLM (``--enable-prompt-embeds``) runs a completion on embeddings sent as base64 tensors: a
    row of hidden-size numbers a token, so the field's size bounds its tokens as a prompt's does."""
    proxy, _ = vllm
    embeds = "QUJD" * 2000  # 8 KB of base64: past what the 3,000-token budget leaves for it
    body = {"model": MODEL, "prompt": "", "prompt_embeds": embeds, "max_tokens": 1}
    assert _post(proxy, "/v1/completions", body).status_code == 429
    assert _post(proxy, "/v1/completions", {**body, "prompt_embeds": "QUJD"}).status_code == 200


@pytest.mark.parametrize(
    "field",
    [{"chat_template_kwargs": {"persona": "word " * 6000}}, {"documents": [{"title": "t", "text": "word " * 6000}]}],
)
def test_template_fields_count_toward_the_prompt(vllm: tuple[LiveServer, Capture], field: dict[str, Any]) -> None:
    """vLLM hands chat_template_kwargs and documents to the chat template, which may render them."""
    proxy, upstream = vllm
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **field}
    assert _post(proxy, "/v1/chat/completions", body).status_code == 429
    assert upstream.bodies == []


@pytest.mark.parametrize(
    ("owner", "listed", "names"),
    [
        # Ollama fills in a name's tag (and namespace, host) and compares in any letter case.
        ("library", "llama3:latest", ["llama3:latest", "llama3", "LLAMA3:latest", "registry.ollama.ai/library/llama3"]),
        # llama-server with one model runs it whatever name the request gives.
        ("llamacpp", "smollm2.gguf", ["smollm2.gguf", "gpt-4o", "anything"]),
    ],
)
def test_a_name_the_engine_resolves_is_budgeted_as_its_model(owner: str, listed: str, names: list[str]) -> None:
    """Looked up as sent, ``llama3`` was no known model: no engine, no context, a 512-token reserve for
    a request with no limit, admitted, while Ollama ran it to the end of num_ctx (4096 > the 3,000
    budget). Every spelling the engine runs as the listed model is that model's decision."""
    context = 4096 if owner == "llamacpp" else None
    for proxy, _ in _proxy(Capture(owner, context, listed), tenants=TENANTS):
        msgs = [{"role": "user", "content": "hi"}]
        answered = {name: _post(proxy, "/v1/chat/completions", {"model": name, "messages": msgs}) for name in names}
        assert {name: r.status_code for name, r in answered.items()} == dict.fromkeys(names, 429)
        bounded = _post(proxy, "/v1/chat/completions", {"model": names[-1], "messages": msgs, "max_tokens": 5})
        assert bounded.status_code == 200, bounded.text


def test_ollama_names_as_ollama_reads_them() -> None:
    from proxy.backends.engines import ollama_name

    full = "registry.ollama.ai/library/qwen2.5:7b"
    assert {ollama_name(n) for n in ("qwen2.5:7b", "QWEN2.5:7B", "library/qwen2.5:7b", full)} == {full}
    assert ollama_name("qwen2.5") == "registry.ollama.ai/library/qwen2.5:latest" != ollama_name("qwen2.5:7b")
    assert ollama_name("example.com:5000/team/m:v1") == "example.com:5000/team/m:v1"
    assert ollama_name("team/m") == "registry.ollama.ai/team/m:latest"
