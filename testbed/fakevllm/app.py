"""The fake vLLM OpenAI-compatible server (FastAPI): one table of every route it serves.

Pipeline per generation request, as in vLLM: validate -> render the chat template ->
tokenize -> admit into the prefix-cache model (hit = ``cached_tokens``) -> sleep for the
uncached prefill -> emit the fake model's tokens -> cache prompt + output blocks -> free.

The handlers are methods of one class per concern, in ``routes/``: ``GenerationRoutes`` (chat
and text completions), ``AnthropicRoutes`` and ``ResponsesRoutes`` (converted to a chat
completion and back, as vLLM does), ``TokenRoutes`` (embeddings, tokenize), ``ServerRoutes``
(models, health, metrics) and ``HookRoutes``; ``routes/checks`` holds what every route checks.

Test-only surface (not in vLLM): the ``fake_options`` body field (see ``FakeOptions``) and the
``/fake/*`` endpoints (``HookRoutes``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from proxy.enginemodel import ChatTokenizer
from testbed.fakevllm.config import FakeBackendConfig
from testbed.fakevllm.engine import FakeEngine
from testbed.fakevllm.routes.anthropic import AnthropicRoutes
from testbed.fakevllm.routes.checks import RequestChecks
from testbed.fakevllm.routes.generation import GenerationRoutes
from testbed.fakevllm.routes.hooks import HookRoutes
from testbed.fakevllm.routes.openai_responses import ResponsesRoutes
from testbed.fakevllm.routes.server import ServerRoutes
from testbed.fakevllm.routes.tokens import TokenRoutes
from testbed.fakevllm.runner import JobRunner


def create_app(config: FakeBackendConfig | None = None, *, tokenizer: ChatTokenizer | None = None) -> FastAPI:
    """A fresh fake backend (its own cache, metrics registry and request log)."""
    config = config or FakeBackendConfig()
    engine = FakeEngine(config, tokenizer)
    checks = RequestChecks(engine, config)
    generation = GenerationRoutes(checks, JobRunner(engine, config, config.response_model))
    messages = AnthropicRoutes(checks, generation)
    responses = ResponsesRoutes(checks, generation)
    tokens = TokenRoutes(checks, engine, config)
    server = ServerRoutes(engine, config)
    hooks = HookRoutes(engine)

    routes: list[tuple[str, str, Callable[..., Any]]] = [
        # OpenAI, Anthropic Messages (vllm/entrypoints/anthropic), OpenAI Responses
        ("POST", "/v1/chat/completions", generation.chat_completions),
        ("POST", "/v1/messages", messages.messages),
        ("POST", "/v1/messages/count_tokens", messages.count_tokens),
        ("POST", "/v1/responses", responses.create_response),
        ("GET", "/v1/responses/{response_id}", responses.retrieve_response),
        ("POST", "/v1/completions", generation.completions),
        ("POST", "/v1/embeddings", tokens.embeddings),
        ("GET", "/v1/models", server.models),
        # vLLM's server-root endpoints
        ("POST", "/tokenize", tokens.tokenize),
        ("POST", "/detokenize", tokens.detokenize),
        ("GET", "/health", server.health),
        ("GET", "/version", server.version),
        ("GET", "/metrics", server.metrics),
        ("POST", "/reset_prefix_cache", server.reset_prefix_cache),
        # test hooks (not in vLLM)
        ("GET", "/fake/requests", hooks.fake_requests),
        ("GET", "/fake/stats", hooks.fake_stats),
        ("POST", "/fake/reset", hooks.fake_reset),
        ("POST", "/fake/cache/lookup", hooks.fake_cache_lookup),
    ]
    app = FastAPI(title="prefix-proxy fake vLLM backend", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.config = config
    for method, path, handler in routes:
        app.add_api_route(path, handler, methods=[method])
    return app
